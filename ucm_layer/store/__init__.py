"""kvfabric.ucm_layer.store: the async store contract (``base.py``) and the stores."""
