"""The devices a job may be given (``--device``): checked before anything is loaded, so that a device
torch does not know, or CUDA on a torch or machine without it, is one line naming the flag."""

from __future__ import annotations

from typing import Optional

KINDS = ("cpu", "cuda")


def check_device(device: Optional[str], flag: str = "--device") -> Optional[str]:
    """``device`` (``cpu``, ``cuda`` or ``cuda:N``) when this machine can run on it, None left as None;
    else ValueError naming ``flag``."""
    if device is None:
        return None
    import torch

    kind, sep, index = str(device).partition(":")
    if kind not in KINDS or (sep and not index.isdigit()) or (sep and kind == "cpu" and index != "0"):
        raise ValueError(f"{flag} {device!r}: not a device this project runs on ({' or '.join(KINDS)}, e.g. cuda:0)")
    if kind == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(f"{flag} {device}: this torch ({torch.__version__}) was built without CUDA; use cpu")
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"{flag} {device}: no CUDA device is visible on this machine; use cpu")
        if sep and int(index) >= count:
            raise ValueError(f"{flag} {device}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return device
