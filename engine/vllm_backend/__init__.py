"""The vLLM backend: vLLM V1 in its own environment, behind `EngineBackend` (issue 19).

`backend.py` is the server's side, `worker.py` the vLLM side (run by the vLLM environment's python),
`process.py` the connection between them, `params.py` the sampling fields vLLM takes.
"""
from .backend import VllmBackend, default_vllm_python

__all__ = ["VllmBackend", "default_vllm_python"]
