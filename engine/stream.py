"""Per-request output bookkeeping: incremental text, stop conditions, deltas.

Invariant: the concatenation of every `text_delta` a request emits equals its
final `text`, and no delta ever contains text at or after a matched stop
string: while the tail of the text could still grow into a stop string, that
tail is held back.
"""

from __future__ import annotations

from kvmesh.engine.model.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from kvmesh.engine.outputs import RequestOutput, TokenLogprob
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.structured.masking import GrammarViolation


class RequestStream:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer)
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.stops = StopChecker(params.stop)
        self.text = ""
        self.sent = 0

    def _output(self, req: Request, new: list[int], lps: list[TokenLogprob] | None, finished: bool,
                reason: str | None, stop_reason: int | str | None) -> RequestOutput:
        upto = len(self.text)
        if not finished and self.stops:
            upto -= self.stops.holdback(self.text)
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            new_token_ids=new,
            output_token_ids=list(req.output_token_ids) if finished else [],
            text_delta=delta,
            text=self.text[: self.sent] if finished else "",
            finished=finished,
            finish_reason=reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            logprobs=lps,
            metrics=req.metrics,
            stop_reason=stop_reason,
            num_output_tokens=len(req.output_token_ids),
        )

    def on_token(self, req: Request, token: int, lp: TokenLogprob | None, max_model_len: int) -> RequestOutput:
        """Account for one sampled token (already appended to req) and decide whether req is done."""
        p = self.params
        reason: str | None = None
        stop_reason: int | str | None = None
        if token in self.stop_ids:
            reason, stop_reason = "stop", token
        elif not p.ignore_eos and token in self.eos:
            reason = "stop"
        else:
            delta = self.detok.add([token])
            if delta:
                self.text += delta
                # Stop strings count only from min_tokens on (EOS and stop ids are masked until then).
                checking = self.stops and len(req.output_token_ids) >= p.min_tokens
                hit = self.stops.check(self.text, len(delta)) if checking else None
                if hit is not None:
                    self.text = hit.text + (hit.stop if p.include_stop_str_in_output else "")
                    reason, stop_reason = "stop", hit.stop
        grammar = req.grammar
        if grammar is not None:
            grammar.catch_up(req.output_token_ids)  # a no-op unless the token came by transfer
        if grammar is not None and grammar.error is not None:
            raise GrammarViolation(f"structured output: {grammar.error}")
        if reason is None and grammar is not None and grammar.stopped:
            reason = "stop"  # the grammar is complete; nothing more may follow
        if reason is None and (len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len):
            reason = "length"
        if reason is not None:
            req.stop_reason = stop_reason
            if stop_reason is None or isinstance(stop_reason, int):
                self.text += self.detok.finish()  # flush bytes held for a partial character
        out = self._output(req, [token], [lp] if lp is not None else None, reason is not None, reason, stop_reason)
        if req.prompt_logprobs is not None and len(req.output_token_ids) == 1:
            out.prompt_logprobs = req.prompt_logprobs
        return out

    def abort_output(self, req: Request) -> RequestOutput:
        return self._output(req, [], None, True, "abort", None)

    def error_output(self, req: Request, message: str) -> RequestOutput:
        out = self._output(req, [], None, True, "error", None)
        out.error = message
        return out
