"""``/metrics`` in Prometheus' text format, under the names llama-server and vLLM use, so their dashboards work:
llama-server's ``llamacpp:*`` token totals and request gauges, vLLM's ``vllm:*`` request gauges and speculative
decoding counters (drafts, draft tokens, accepted tokens, accepted tokens per position), and our own
``pyllama_dspark:*`` request outcomes and draft counts by source (lookup, history, grammar, dspark)."""

from __future__ import annotations


def prometheus_text(counters, model_name: str, n_waiting: int, n_slots: int) -> str:
    c = counters
    label = f'model_name="{_escape(model_name)}"'
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", c.prompt_tokens),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time.", c.prompt_seconds),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", c.generated_tokens),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time.", c.generation_seconds),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", c.requests_processing),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", n_waiting),
    ]
    vllm = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
         c.requests_processing),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", n_waiting),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", c.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", c.generated_tokens),
        ("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", c.drafts),
        ("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", c.draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", c.accepted_tokens),
    ]
    ours = [
        ("pyllama_dspark:slots_total", "gauge", "Requests the server decodes at once (--parallel).", n_slots),
        ("pyllama_dspark:slots_busy", "gauge", "Slots holding a request now.", c.requests_processing),
        ("pyllama_dspark:prompt_tokens_cached_total", "counter",
         "Prompt tokens taken from the prompt cache (a slot's memory of its last request), not evaluated.",
         c.prompt_tokens_cached),
        ("pyllama_dspark:requests_finished_total", "counter", "Requests whose generation ended normally.",
         c.requests_finished),
        ("pyllama_dspark:requests_cancelled_total", "counter",
         "Requests cancelled by their client's disconnect (or by shutdown), running or waiting.", c.requests_cancelled),
    ]
    lines = []
    for name, kind, help_text, value in rows + ours:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
    for name, kind, help_text, value in vllm:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {_number(value)}"]
    for name, index, help_text in (("pyllama_dspark:draft_rounds_total", 0, "Verify rounds drafted, by source."),
                                   ("pyllama_dspark:draft_tokens_total", 1, "Draft tokens verified, by source."),
                                   ("pyllama_dspark:accepted_tokens_total", 2, "Draft tokens accepted, by source.")):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        lines += [f'{name}{{{label},source="{_escape(source)}"}} {counts[index]}'
                  for source, counts in sorted(c.by_source.items())]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Accepted tokens per draft position.", f"# TYPE {name} counter"]
    lines += [f'{name}{{{label},position="{i}"}} {n}' for i, n in enumerate(c.accepted_per_pos)]
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
