"""What every stage uses and none owns: atomic writes (atomic.py), JSON (jsonio.py), words and names (words.py,
class_names.py), interrupts, devices, the toolkit's cache folder (cache.py), foreign files, outputs and plot files."""
