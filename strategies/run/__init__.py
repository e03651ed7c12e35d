"""What a run does around a method: the round loop, checkpoints and resume, the run notes and the report."""
