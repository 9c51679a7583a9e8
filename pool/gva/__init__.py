"""kvfabric.pool.gva: the global virtual address space and ``xcopy`` between any two windows.

``gva = base[medium] + rank * stride[medium] + offset``: one integer names the same byte
in every process of the pool.
"""
