"""The federated task that the server and the clients share (Flower's ``task.py`` convention).

:mod:`.data` loads and partitions the datasets, :mod:`.models` builds the models and moves their weights,
:mod:`.training` trains and evaluates them (plain and per-example clipped SGD).  Flower-free.
"""
