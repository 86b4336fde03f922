"""Server counters since start, rendered as Prometheus text or JSON (``GET /metrics``)."""
from __future__ import annotations

import time

from dflash_gguf.decoding.stats import GenerationStats


class Metrics:
    """Counters since start; rendered as Prometheus text or JSON."""

    def __init__(self):
        self.started = time.time()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = 0
        self.spec = GenerationStats()          # every DFlash generation since start, merged
        self.dflash_requests = self.plain_requests = self.disconnects = 0
        self.timeouts = self.rejected = 0      # --request-timeout expired; 503 because --max-queue was full
        self.fallbacks: dict[str, int] = {}   # plain decoding with a drafter loaded, by reason
        self.last_tokens_per_second = 0.0
        self.in_flight = 0
        self.slots = None                      # --parallel: the batched engine (server.slots.Slots)

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def generation(self, dflash: dict | None, usage: dict | None) -> None:
        if usage:
            self.prompt_tokens += int(usage.get("prompt_tokens", 0))
            self.completion_tokens += int(usage.get("completion_tokens", 0))
        if dflash is None or not dflash.get("enabled", True):
            self.plain_requests += 1
            if dflash is not None:
                reason = str(dflash.get("reason") or "unknown")
                self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            return
        self.dflash_requests += 1
        self.spec.merge(GenerationStats.from_dict(dflash))
        self.last_tokens_per_second = dflash["tokens_per_second"]
        if not usage:
            self.completion_tokens += dflash.get("n_generated", 0)
            self.prompt_tokens += dflash.get("n_prompt", 0)

    def as_dict(self) -> dict:
        st = self.spec
        return {
            "uptime_seconds": round(time.time() - self.started, 3),
            "requests": [{"endpoint": e, "status": s, "count": n} for (e, s), n in sorted(self.requests.items())],
            "requests_in_flight": self.in_flight,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "dflash_requests": self.dflash_requests, "plain_requests": self.plain_requests,
            "dflash_steps": st.steps, "dflash_drafted": st.drafted, "dflash_accepted": st.accepted,
            "acceptance_length": round(st.tau, 4) if st.steps else None,
            "acceptance_rate": round(st.accept_rate, 4) if st.drafted else None,
            "dflash_tokens_per_second": round(st.tokens_per_second, 2) if st.t_decode > 0 else None,
            "last_tokens_per_second": self.last_tokens_per_second,
            "client_disconnects": self.disconnects,
            "timeouts": self.timeouts, "rejected_queue_full": self.rejected,
            "fallbacks": [{"reason": r, "count": n} for r, n in sorted(self.fallbacks.items())],
            "slots": None if self.slots is None else self.slots.figures(),
        }

    def prometheus(self) -> str:
        d = self.as_dict()
        out = []

        def metric(name, kind, help_, value, labels=""):
            if f"# TYPE dflash_{name} " not in "".join(out):
                out.append(f"# HELP dflash_{name} {help_}\n# TYPE dflash_{name} {kind}\n")
            out.append(f"dflash_{name}{labels} {0 if value is None else value}\n")

        for r in d["requests"]:
            metric("requests_total", "counter", "HTTP requests by endpoint and status", r["count"],
                   f'{{endpoint="{r["endpoint"]}",status="{r["status"]}"}}')
        metric("requests_in_flight", "gauge", "generation requests running or waiting", d["requests_in_flight"])
        metric("prompt_tokens_total", "counter", "prompt tokens of served requests", d["prompt_tokens"])
        metric("completion_tokens_total", "counter", "generated tokens", d["completion_tokens"])
        help_ = "generations by decoding path: dflash, or plain (a fallback, or dflash off)"
        metric("generations_total", "counter", help_, d["dflash_requests"], '{path="dflash"}')
        metric("generations_total", "counter", help_, d["plain_requests"], '{path="plain"}')
        for f in d["fallbacks"]:
            reason = f["reason"].replace("\\", "\\\\").replace('"', '\\"')
            metric("fallbacks_total", "counter", "generations served by plain decoding although a drafter is loaded, "
                   "by reason", f["count"], f'{{reason="{reason}"}}')
        metric("steps_total", "counter", "DFlash draft-verify steps", d["dflash_steps"])
        metric("drafted_tokens_total", "counter", "tokens proposed by the drafter", d["dflash_drafted"])
        metric("accepted_tokens_total", "counter", "drafted tokens accepted by the target", d["dflash_accepted"])
        metric("acceptance_length", "gauge", "mean tokens committed per DFlash step since start", d["acceptance_length"])
        metric("tokens_per_second", "gauge", "DFlash decode speed since start (after prefill)",
               d["dflash_tokens_per_second"])
        metric("client_disconnects_total", "counter", "generations stopped because the client went away",
               d["client_disconnects"])
        metric("timeouts_total", "counter", "requests stopped by --request-timeout", d["timeouts"])
        metric("rejected_total", "counter", "requests refused with 503 because --max-queue requests were waiting",
               d["rejected_queue_full"])
        if d["slots"] is not None:
            sl = d["slots"]
            metric("slots", "gauge", "--parallel: sequences the batched engine runs per step at most", sl["total"])
            metric("slots_busy", "gauge", "--parallel: slots with a running request", sl["busy"])
            metric("slots_waiting", "gauge", "--parallel: requests waiting for a slot", sl["waiting"])
            metric("kv_cells", "gauge", "--parallel: KV cells of the slots' cache", sl["cells"])
            metric("kv_cells_used", "gauge", "--parallel: KV cells the slots' tokens hold", sl["cells_used"])
            metric("slots_preempted_total", "counter", "--parallel: requests that gave their cells back to resume "
                   "later (the shared cache was full)", sl["preempted"])
            metric("batch_steps_total", "counter", "--parallel: steps of the batched engine", sl["steps"])
            metric("batch_sequences_total", "counter", "--parallel: sequences summed over those steps "
                   "(over batch_steps_total: the mean batch size)", sl["sequences"])
        metric("uptime_seconds", "gauge", "seconds since the server started", d["uptime_seconds"])
        return "".join(out)
