"""kvfabric.ucm_layer.sparse: the sparse-attention plugin hooks and GSA block-sparse decode."""
