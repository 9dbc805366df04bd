"""The layers as the engine runs them: the decoder layer's forward, the int8 linears, the int8 MoE, and the
swap of the float C modules into a model."""
