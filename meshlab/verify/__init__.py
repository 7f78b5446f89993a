"""The check against one process: a layout's run beside the same model trained in one
process (compare.py), the references it reuses, float64 variants, check="tiny". Imports the
strategies and the replica modes; nothing in them imports it back."""
