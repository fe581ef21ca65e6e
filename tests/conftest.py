"""Shared test fixtures. MLX gets the system OpenBLAS first (several times faster here)."""
from specprefill.blas import preload_openblas

preload_openblas()
