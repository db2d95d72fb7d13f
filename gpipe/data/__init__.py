"""Data sources that ship with gpipe: token files and local Hugging Face datasets."""
