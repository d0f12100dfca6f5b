"""The output stage: a step's ModelOutput becomes tokens for the Scheduler and Responses.

Everything between the model's results and what a caller reads happens here, once: stop
checks (EOS, stop tokens, stop words, the length limit), incremental detokenization,
logprobs, speculative draft counts, and the final Response of a beam-search request.
Each Response is a delta: the tokens, logprobs and text new since the request's previous
one, so a step's cost does not grow with the length of the answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from lmengine.engine.detokenize import IncrementalDetokenizer
from lmengine.engine.record import RequestRecord
from lmengine.engine.request import AddRequest, Response
from lmengine.engine.research import HiddenStates
from lmengine.engine.step import ModelOutput
from lmengine.scheduler.output import SchedulerOutput
from lmengine.scheduler.sequence import Sequence


@dataclass(eq=False)
class OutputState:
    """What the output stage made of one request so far: text, logprobs, draft counts and
    research results. Part of the request's record; only the output stage writes it."""

    detok: IncrementalDetokenizer | None
    new_logprobs: list[dict[int, float]] | None  # when asked: of the tokens not yet sent
    text: str | None = None  # the whole text so far (stop words are searched in it)
    num_sent_chars: int = 0  # of `text`, in Responses already built
    num_sent_tokens: int = 0  # generated tokens in Responses already built
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when asked: filled in prefill
    hidden: HiddenStates | None = None  # when asked
    pooled: HiddenStates | None = None  # GenerationConfig.pooling: the final norm's rows
    stop_reason: str | int | None = None  # the stop word or stop token id that ended it

    def record_research(self, item, output: ModelOutput) -> None:
        """Keep what the step computed for the request's research asks: prompt logprobs (once
        per prompt token: a recomputed prefill scores the same tokens again) and hidden
        states (the positions this step ran)."""
        seq_id = item.seq.seq_id
        scored = output.prompt_logprobs.get(seq_id)
        if scored is not None and self.prompt_logprobs is not None:
            first, entries = scored
            have = len(self.prompt_logprobs)
            self.prompt_logprobs.extend(entries[have - first :] if have >= first else ())
        rows = output.hidden_states.get(seq_id)
        if rows is not None:
            for kept in (self.hidden, self.pooled):
                if kept is not None:
                    kept.write(item.start_pos, rows)

    def text_delta(self, stop_words: list[str] | None, finished: bool) -> str | None:
        """The text to send now, and mark it sent. While running, a tail that may start a
        stop word is held back (so no sent text is ever taken back)."""
        if self.text is None:
            return None
        end = len(self.text)
        if stop_words and not finished:
            end = max(self.num_sent_chars, end - (max(len(w) for w in stop_words) - 1))
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta


def _response(
    record: RequestRecord, new_tokens: list[int], num_generated: int, finish_reason: str | None
) -> Response:
    """The request's next delta: `new_tokens` not sent before, `num_generated` in all."""
    state, seq = record.output, record.seq
    hidden = None
    if state.hidden is not None:  # positions run: all but the last token (once there is one)
        total = seq.num_prompt_tokens + num_generated
        hidden = state.hidden.view(
            min(state.hidden.num_valid, total - 1 if num_generated else total)
        )
    embedding = None
    pooling = record.request.gen_config.pooling
    if state.pooled is not None and finish_reason not in (None, "error") and pooling:
        embedding = state.pooled.pool(pooling, seq.num_prompt_tokens)
    state.num_sent_tokens = num_generated
    logprobs = state.new_logprobs
    if logprobs is not None:
        state.new_logprobs = []
    return Response(
        text=state.text_delta(record.request.gen_config.stop_words, finish_reason is not None),
        token_ids=new_tokens,
        finish_reason=finish_reason,
        input_token_len=seq.num_prompt_tokens,
        generate_token_len=num_generated,
        logprobs=logprobs,
        num_draft_tokens=state.num_draft_tokens,
        num_accepted_tokens=state.num_accepted_tokens,
        prompt_logprobs=state.prompt_logprobs,
        hidden_states=hidden,
        embedding=embedding,
        stop_reason=state.stop_reason if finish_reason == "stop" else None,
        metrics=record.request.metrics,
    )


@dataclass
class StepResult:
    """What the output stage made of one step."""

    # for the Scheduler, by sequence
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> tokens to append
    finished: list[Sequence] = field(default_factory=list)  # sequences that end with this step
    # for the callers, by request
    responses: list[tuple[AddRequest, Response]] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)  # ids of the requests this step ends


class OutputProcessor:
    """Turns each step's results into Responses, writing only the records' output state.
    Never touches the model, and changes no scheduler state: the tokens and finished
    sequences it returns go to `Scheduler.update`, after it (it reads each Sequence as it
    was before this step's tokens: `seq.num_generated_tokens` counts the earlier ones)."""

    def __init__(self, tokenizer, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)

    def new_state(self, req: AddRequest, seq: Sequence) -> OutputState:
        """The output state of a request that starts."""
        detok = None
        if self.tokenizer is not None:
            cfg = req.gen_config
            detok = IncrementalDetokenizer(self.tokenizer, req.input_ids, cfg.skip_special_tokens)
        new_logprobs: list[dict[int, float]] | None = None
        if req.gen_config.logprobs is not None:
            new_logprobs = []
        text = "" if detok is not None else None
        state = OutputState(detok, new_logprobs, text)
        spec = seq.research
        if spec is not None:
            if spec.prompt_logprobs is not None:  # None before the first scored token
                first = min(max(1, spec.prompt_logprobs_start), seq.num_prompt_tokens)
                state.prompt_logprobs = [None] * first
            state.hidden = HiddenStates(spec.hidden_layers) if spec.hidden_layers else None
            if spec.pooling is not None:
                state.pooled = HiddenStates((spec.pool_layer,))
        return state

    def process(
        self,
        out: SchedulerOutput,
        output: ModelOutput,
        requests: Mapping[int, RequestRecord],
        step: int = 0,
        started: float = 0.0,
    ) -> StepResult:
        """Check every sampled token for a stop, in order (with speculative decoding, tokens
        after a stop are dropped), and build one Response per request that sampled.
        `requests`: the engine's records by request id; `step` and `started`: the engine's
        step number and its start (RequestMetrics)."""
        result = StepResult()
        has_research = bool(output.prompt_logprobs or output.hidden_states)
        now = time.monotonic()
        for item in out.scheduled:
            seq = item.seq
            record = requests[seq.request_id]
            state = record.output
            metrics = record.request.metrics
            if metrics.first_scheduled_step is None:
                metrics.first_scheduled_step, metrics.first_scheduled_time = step, started
            if has_research:
                state.record_research(item, output)
            res = output.sequences.get(seq.seq_id)
            if res is None:
                continue
            if state.hidden is not None:  # the chunk's positions, and the accepted drafts'
                # NOTE: only a step that samples answers, and its chunk ends at the last
                # computed position, so earlier chunks need no mark of their own
                end = item.start_pos + item.num_new_tokens + res.num_accepted_tokens
                state.hidden.num_valid = max(state.hidden.num_valid, end)
            accepted: list[int] = []
            reason = None
            if res.error is not None:
                reason = "error"
            elif record.request.gen_config.max_new_tokens == 0:
                reason = "length"  # the prompt only: scoring, reading activations
            else:
                for i, token_id in enumerate(res.token_ids):
                    logprobs = res.logprobs[i] if res.logprobs is not None else None
                    reason = self._check_stop(record, token_id, logprobs, len(accepted))
                    accepted.append(token_id)
                    if reason is not None:
                        break
            if accepted and metrics.first_token_step is None:
                metrics.first_token_step, metrics.first_token_time = step, now
            result.new_tokens[seq.seq_id] = accepted
            state.num_draft_tokens += res.num_draft_tokens
            state.num_accepted_tokens += res.num_accepted_tokens
            num_generated = seq.num_generated_tokens + len(accepted)  # NOTE: before update
            response = _response(record, accepted, num_generated, reason)
            response.error = res.error
            result.responses.append((record.request, response))
            if reason is not None:
                result.finished.append(seq)
                result.ended.append(seq.request_id)
        return result

    def _check_stop(
        self, record: RequestRecord, token_id: int, logprobs: dict | None, pending: int
    ) -> str | None:
        """Record a sampled token in the request's text and logprobs; return a finish reason
        or None. `pending`: tokens accepted before this one in the same step (speculative)."""
        state, seq, cfg = record.output, record.seq, record.request.gen_config
        if state.new_logprobs is not None:
            state.new_logprobs.append(logprobs or {})
        scan_from = len(state.text) if state.text is not None else 0
        if state.detok is not None:
            state.detok.add(token_id)
            state.text = state.detok.text
        if seq.num_generated_tokens + pending + 1 > cfg.min_new_tokens:
            if not cfg.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if cfg.stop_token_ids and token_id in cfg.stop_token_ids:
                state.stop_reason = token_id
                return "stop"
            if cfg.stop_words and state.text is not None:
                for word in cfg.stop_words:
                    at = state.text.find(word, max(0, scan_from - len(word) + 1))
                    if at >= 0:
                        state.text = state.text[:at]
                        state.stop_reason = word
                        return "stop"
        if seq.num_tokens + pending + 1 >= seq.max_num_tokens:
            return "length"
        return None

    def beam_responses(self, records: list[RequestRecord], result: StepResult) -> None:
        """The final Response of each beam request whose group is done, into `result`."""
        for record in records:
            group, req = record.beams, record.request
            assert group is not None
            cfg = req.gen_config
            tokens, scores = group.results(cfg.num_return_sequences)
            best = tokens[0]
            texts = None
            if self.tokenizer is not None:
                texts = [self._text(t, req.input_ids, cfg.skip_special_tokens) for t in tokens]
            ends = bool(best) and best[-1] in group.eos_token_ids
            response = Response(
                text=texts[0] if texts is not None else None,
                token_ids=best,
                finish_reason="stop" if ends else "length",
                input_token_len=group.prompt_len,
                generate_token_len=len(best),
                beam_token_ids=tokens,
                beam_scores=scores,
                beam_texts=texts,
                metrics=req.metrics,
            )
            result.responses.append((req, response))
            result.ended.append(record.request_id)

    def _text(self, tokens: list[int], prompt: list[int], skip: bool) -> str:
        detok = IncrementalDetokenizer(self.tokenizer, prompt, skip)
        for t in tokens:
            detok.add(t)
        return detok.text

    def final_response(self, record: RequestRecord, reason: str, error: str | None) -> Response:
        """The last delta of a request that ends outside a step's results (cancelled,
        failed): what its best sequence generated and no Response has carried yet."""
        seq, sent = record.best_sequence(), record.output.num_sent_tokens
        unsent = seq.token_ids[seq.num_prompt_tokens + sent :]
        response = _response(record, unsent, sent + len(unsent), reason)
        response.error = error
        return response
