"""SpecPrefill: draft-model token scoring and chunk selection on MLX.

Import-light on purpose: ``specprefill.blas`` must run before mlx is imported, so this
package imports nothing; use the submodules (``specprefill.scoring``, ``.selection``, ...).
"""
