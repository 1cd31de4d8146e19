"""The SGLang engine (engine.py), the attention backends it registers in SGLang's scheduler (triton_backend.py,
kv_backend.py), and what both sides agree on (contract.py); importing this package does not import SGLang."""
