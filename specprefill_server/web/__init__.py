"""The web page at ``/``: its routes, the data it reads from the queue, one job's view, the importance curve."""
