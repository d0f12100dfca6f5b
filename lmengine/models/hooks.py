"""Per-request research hooks inside the forward: steering additions and hidden-state copies.

`LayerHooks.build` turns one step's asks (per sequence: the layers to read, the vectors to
add) into packed-row index tensors, once per step. The patched models call `after_layer(i,
hidden, residual)` after the embeddings (i = 0) and after every decoder layer i, and
`after_norm(hidden)` on the backbone's final output (i = num_layers), the indices of
transformers' `output_hidden_states`. Only the rows of the requests that asked are touched;
a step without asks has no LayerHooks at all (`StepContext.hooks is None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqHooks:
    """One sequence's asks, placed in the packed batch."""

    seq_id: int
    first_row: int  # packed row of the sequence's first token this step
    num_rows: int  # its tokens this step (chunk and drafts)
    start_pos: int  # position of its first token this step
    layers: tuple[int, ...] = ()  # hidden states to copy out
    # (layer, vector [hidden] already scaled, first position steered)
    steering: tuple[tuple[int, torch.Tensor, int], ...] = ()


class LayerHooks:
    """One step's hooks. `captured` fills during the forward; `by_sequence` splits it."""

    def __init__(self, seqs: list[SeqHooks], num_layers: int, device: torch.device) -> None:
        self.num_layers = num_layers
        rows: dict[int, list[torch.Tensor]] = {}
        self.owners: dict[int, list[tuple[int, int]]] = {}  # layer -> (seq_id, num_rows)
        steer_rows: dict[int, list[torch.Tensor]] = {}
        steer_values: dict[int, list[torch.Tensor]] = {}
        for s in seqs:
            span = torch.arange(s.first_row, s.first_row + s.num_rows)
            for layer in s.layers:
                rows.setdefault(layer, []).append(span)
                self.owners.setdefault(layer, []).append((s.seq_id, s.num_rows))
            for layer, vector, start in s.steering:
                skip = min(max(0, start - s.start_pos), s.num_rows)  # rows before `start`
                if skip == s.num_rows:
                    continue
                steer_rows.setdefault(layer, []).append(span[skip:])
                steer_values.setdefault(layer, []).append(vector.expand(s.num_rows - skip, -1))
        self.capture = {i: torch.cat(r).to(device) for i, r in rows.items()}  # layer -> [n]
        self.steer = {
            i: (
                torch.cat(r).to(device),  # [n] packed rows
                torch.cat(steer_values[i]).to(device),  # [n, hidden] float32
            )
            for i, r in steer_rows.items()
        }
        self.captured: dict[int, torch.Tensor] = {}  # layer -> [n, hidden]

    @classmethod
    def build(
        cls, seqs: list[SeqHooks], num_layers: int, device: torch.device
    ) -> LayerHooks | None:
        """The hooks of a step, or None when no sequence asks for any."""
        seqs = [s for s in seqs if s.layers or s.steering]
        return cls(seqs, num_layers, device) if seqs else None

    def after_layer(
        self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> None:
        """After layer `index` (0: the embeddings): add the steering vectors to `hidden` in
        place, then copy out the asked rows of the residual stream, `hidden + residual` for
        models that defer the residual add into the next norm. hidden: [num_tokens, hidden]."""
        steer = self.steer.get(index)
        if steer is not None:
            rows, values = steer
            hidden.index_add_(0, rows, values.to(hidden.dtype))
        if index < self.num_layers:  # the last layer's stream is read after the final norm
            rows = self.capture.get(index)
            if rows is not None:
                stream = hidden.index_select(0, rows)
                if residual is not None:
                    stream += residual.index_select(0, rows)
                self.captured[index] = stream

    def after_norm(self, hidden: torch.Tensor) -> None:
        """The backbone's final output (index num_layers, as transformers reports it)."""
        rows = self.capture.get(self.num_layers)
        if rows is not None:
            self.captured[self.num_layers] = hidden.index_select(0, rows)

    def by_sequence(self) -> dict[int, dict[int, torch.Tensor]]:
        """seq_id -> layer -> that sequence's rows [num_rows, hidden], in position order."""
        out: dict[int, dict[int, torch.Tensor]] = {}
        for layer, owners in self.owners.items():
            parts = self.captured[layer].split([n for _, n in owners])
            for (seq_id, _), part in zip(owners, parts):
                out.setdefault(seq_id, {})[layer] = part
        return out
