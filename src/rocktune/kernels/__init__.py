"""Attention kernels: the glue of torch's varlen attention over packed rows, its choice and self-test
(``attention.py``). The compiler-opaque CPU stand-in the tests measure against lives with the tests
(tests/varlen_standin.py)."""
