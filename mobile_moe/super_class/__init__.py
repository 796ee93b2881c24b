"""Super-classes: derive them from a dense model's confusion graph, read and write super-class files."""
