"""Model families and built-in model sources, torch-free at import: the family table and shape specs (``table``), the
built-in tiny model (``tiny``) and the GGUF-packaged pretrained model (``gguf``). Both ``config`` and ``models`` read
them, so they sit below both."""
