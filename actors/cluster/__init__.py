"""Ray for a job, whichever job: a private local Ray or the cluster an address names, the reaper that stops a
private Ray left behind, and what a Ray task error means for the caller."""
