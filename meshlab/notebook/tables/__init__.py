"""DataFrames built on the notebook side from what the ranks report (comms, memory)."""
