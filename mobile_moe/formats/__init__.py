"""The file formats every stage reads: super-class files (superclasses.py) and confusion files (confusion.py). Data
specs and training read them, super_class derives and writes them; their one reader and writer each lives here, on the
ground floor, so nothing below the derivation imports it. versions.py is the one rule every versioned format's reader
applies to its version."""
