"""The vLLM backend: vLLM V1 in its own environment, behind `EngineBackend`.

`backend.py` is the server's side (`VllmBackend`, exported by `infercept.engine`), `worker.py` the vLLM side
(run by the vLLM environment's python), `process.py` the connection between them, `params.py` the sampling
fields vLLM takes, `scheduler.py` our policy inside vLLM (loaded by vLLM in its engine-core process),
`policy_parts.py` which of the policy's parts run there (read on both sides). This
package imports nothing itself, so vLLM's python imports `engine.vllm_backend.scheduler` without the
server-side modules.
"""
