"""Pure array functions, one folder per op, layout [B, T, H, D]. No Flax here."""
