"""lm-evaluation-harness, unmodified, scores continuations against the live server: its
`local-completions` model sends each context + continuation as token ids with `echo`, `logprobs` 1 and
`max_tokens` 1, and reads the continuation's logprobs off the echoed prompt (server/serving_completions.py).
The log-likelihoods and greedy verdicts it gets are transformers' in fp32."""
from __future__ import annotations

import torch

from live_server import MODEL

PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " a banana"),
         ("Water boils at 100 degrees", " Celsius at sea level."), ("One, two, three,", " four")]


def test_loglikelihoods_are_transformers(srv, default_model_dir, hf_model_fp32):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model=MODEL, base_url=srv.url + "/completions", tokenizer=default_model_dir,
                             batch_size=2, max_retries=1)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    scored = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (loglikelihood, greedy) in zip(PAIRS, scored):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)  # its own split
        ids = context_ids + continuation_ids
        with torch.no_grad():
            logprobs = hf_model_fp32(torch.tensor([ids])).logits[0].log_softmax(-1)
        rows = logprobs[len(context_ids) - 1:-1]
        expected = float(rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum())
        assert abs(loglikelihood - expected) < 1e-3 * len(ids)
        assert greedy == (rows.argmax(-1).tolist() == continuation_ids)
    assert scored[0][0] > scored[1][0]  # Paris over a banana
    assert any(greedy for _, greedy in scored) and not all(greedy for _, greedy in scored)
