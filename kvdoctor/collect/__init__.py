"""Live sources for `kvdoctor attach`: each a small module behind one interface (base.py)."""
