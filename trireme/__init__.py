"""trireme: train transformer language models at any scale, with code you can read."""

__version__ = "0.1.0"
