"""kvfabric.pool: the object pool with memory semantics (MemCache-like).

A meta service allocates space in the global virtual address windows (``pool.gva``) and
keeps the directory; clients write and read the memory directly, so object data never
passes through the service. Imports only ``kvfabric.platform`` below it.
"""
