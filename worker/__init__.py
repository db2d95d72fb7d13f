"""The worker side of gpipe: a stage, its channels, and the attempt process."""
