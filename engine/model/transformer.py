"""The decoder-only transformer, written for one device.

token embedding → n_layers × [x + attn(norm(x)); x + mlp(norm(x))] → norm → output head.
With `model.num_experts > 0` the mlp of every `moe_frequency`-th block is a mixture of experts
(engine/model/moe.py): such a block also returns its routing statistics, which the transformer keeps from
the last forward (`moe_loss()` for the training loss; `engine.model.routing_metrics.moe_metrics` reports them). The
sigmoid router's balancing bias is updated from outside, by hooks the trainer attaches
(engine/train/balancing.py): this forward has no side effect on it.
Parallelism (FSDP, TP, PP) is applied to this module from outside by `engine.parallel`; nothing here
knows about sharding. A pipeline stage (engine/parallel/pipeline.py) is a copy of this module with the layers
it does not own deleted and `tok_embeddings` (all but the first stage, and the last when it runs multi-token
prediction) or `norm`/`output` (all but the last) set to None: forward then takes hidden states (a floating
tensor, where the first stage takes token ids) or returns them, and parameter names stay those of the full model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.model.attention import Attention
from engine.model.documents import document_positions, packed_attention_mask
from engine.model.kv_cache import KVCache, LayerKV
from engine.model.mlp import GatedMLP
from engine.model.moe import MoE, MoEStats
from engine.model.mtp import build_mtp
from engine.model.mup import mup_plan, output_multiplier
from engine.model.norms import build_norm
from engine.model.rope import rope_tables


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, moe: bool | None = None) -> None:
        """`moe`: whether the feed-forward is a mixture of experts; by default as `cfg` places them at `layer`."""
        super().__init__()
        self.attention_norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        moe = cfg.is_moe_layer(layer) if moe is None else moe
        self.feed_forward = MoE(cfg) if moe else GatedMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoEStats | None]:
        """→ (output, the MoE layer's routing stats or None for a dense block). The stats are returned, not
        stored, so that compile and activation checkpointing (which reruns this in backward) see no side
        effects. `mask`: packed documents' attention mask (see Attention.forward)."""
        # mask by keyword: tensor parallelism's PrepareModuleInput lays out the positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, mask=mask)
        if isinstance(self.feed_forward, MoE):
            out, stats = self.feed_forward(self.ffn_norm(x))
            return x + out, stats
        return x + self.feed_forward(self.ffn_norm(x)), None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Embedding, norm and head become None on pipeline stages that do not own them.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Multi-token prediction modules (engine/model/mtp.py), run only when a training loss asks (`mtp=True`).
        self.mtp: nn.ModuleDict | None = build_mtp(cfg)
        cos, sin = rope_tables(cfg)
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.last_moe_stats: dict[str, MoEStats] = {}  # layer name → routing stats of the last forward
        self.output_multiplier = output_multiplier(cfg)  # μP's logit multiplier (1 under sp): engine/model/mup.py
        self.init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: object = None,
        mtp: bool = False,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [batch, seq] → logits [batch, seq, vocab]. Without a cache (training) the tokens are
        positions 0 … seq-1; with one (inference) they continue the cached positions, and are added to it.
        With return_hidden, the final-normed hidden states [batch, seq, dim] (times μP's output multiplier)
        instead of logits, for losses that
        project them through `output.weight` chunk by chunk (engine.train.losses.chunked_cross_entropy).
        A pipeline stage after the first takes the previous stage's hidden states [batch, seq, dim] (floating
        point, where token ids are integers) as `tokens`; one without `output` returns its last block's hidden
        states (not normed).
        doc_ids [batch, seq] (packed documents, engine.model.documents): each token's document in its window;
        positions restart at every document and attention stays inside it. Training only (no cache).
        `positions` [seq], the tokens' places in their sequences, replaces 0 … seq-1 where a rank holds only
        some positions of each sequence (context parallelism passes them, engine/parallel/context.py), or
        [batch, seq] positions in their documents. `attention_mask`, handed to every attention core as it is,
        replaces the mask built from doc_ids where the cores take another form of it (context parallelism
        passes what its cores make of the whole window's document ids, with the positions).
        With `mtp` (a training loss, on a model with `model.mtp_depth` > 0) → (that output, one per
        multi-token-prediction module k = 1 … D: its logits [batch, seq, vocab] over the whole window, of which
        the first seq − k positions predict, or with return_hidden its final-normed states), from the main
        model's last block output before the final norm; on a pipeline's last stage, which receives hidden
        states, the window's token ids come as `mtp_tokens` (the stages before it ignore `mtp`)."""
        seq = tokens.shape[1]
        takes_ids = not tokens.is_floating_point()
        start = 0 if cache is None else cache.length
        mask = attention_mask
        if doc_ids is not None:
            assert cache is None, "doc_ids are for packed training windows, not generation"
            positions, mask = (
                document_positions(doc_ids),
                packed_attention_mask(doc_ids, self.cfg.head_dim, self.cfg.sliding_window),
            )
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            # A later pipeline stage under sequence parallelism gets only its share of the positions, so `seq`
            # is not the attention's length there: it takes the tables from `start` on (apply_rope cuts them).
            end = start + seq if takes_ids else None
            cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        h = self.tok_embeddings(tokens) if takes_ids else tokens
        moe_stats = {}
        for name, block in self.layers.items():
            layer_cache = None if cache is None else cache.layer(name, seq)
            h, stats = block(h, cos, sin, layer_cache, mask=mask)
            if stats is not None:
                moe_stats[name] = stats
        self.last_moe_stats = moe_stats
        if cache is not None:
            cache.length += seq
        if self.output is None:
            return h
        out = self.norm(h)
        if self.output_multiplier != 1.0:  # on the head's input, so the chunked loss (return_hidden) gets it too
            out = out * self.output_multiplier
        out = out if return_hidden else self.output(out)
        if not mtp:
            return out
        ids = tokens if mtp_tokens is None else mtp_tokens
        return out, self.mtp_outputs(h, ids, cos, sin, return_hidden)

    def mtp_outputs(
        self, hidden: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, return_hidden: bool
    ) -> list[torch.Tensor]:
        """Module k's logits (or final-normed states) over the whole window, from the states `hidden` of the
        main model's last block and the embeddings of the tokens k positions ahead (engine/model/mtp.py); its
        predictions are the first seq − k positions (the loss cuts the rest: `with_mtp_loss`).

        Every module runs over the whole window, position i taking token i + k, the last k positions the
        window's first tokens (rolled round): causal attention keeps the rolled tokens out of the first
        seq − k positions, and the stream keeps the main model's length, so under sequence parallelism each
        rank holds its even share of every module's positions, the embedding, norms and head go through the
        same tensor-parallel styles as the main model's, and a pipeline's last stage can send all the outputs
        as one tensor."""
        assert self.mtp is not None, "mtp=True needs model.mtp_depth > 0"
        assert cos.dim() == 2, "multi-token prediction takes windows of plain positions (engine/model/rules.py)"
        outputs = []
        for k, module in self.mtp.items():
            ahead = torch.roll(tokens, -int(k), dims=1)
            hidden, normed = module(hidden, self.tok_embeddings(ahead), cos, sin)
            outputs.append(normed if return_hidden else self.output(normed))
        return outputs

    @torch.no_grad()
    def reset_rope_tables(self) -> None:
        """Recompute the RoPE tables in place. They are derived, not saved: a model built on the meta device
        and materialized with `to_empty` (large multi-process runs) gets them back this way."""
        cos, sin = rope_tables(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def moe_layers(self) -> dict[str, MoE]:
        """Layer name → MoE feed-forward of every MoE block (empty for a dense model)."""
        return {name: block.feed_forward for name, block in self.layers.items() if isinstance(block.feed_forward, MoE)}

    def moe_routers(self) -> dict[str, nn.Module]:
        """Layer name → router of every MoE block (empty for a dense model)."""
        return {name: moe.router for name, moe in self.moe_layers().items()}

    def moe_loss(self) -> torch.Tensor | None:
        """The weighted auxiliary losses of the last forward, summed over MoE blocks (None when dense)."""
        if not self.last_moe_stats:
            return None
        return torch.stack([s.loss for s in self.last_moe_stats.values()]).sum()

    def new_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `capacity` positions, on the model's device and dtype."""
        weight = self.tok_embeddings.weight
        return KVCache(self.cfg, list(self.layers), batch, capacity, weight.device, weight.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere (biases 0); the projections that write into the residual stream (attention
        wo, MLP w2) get init_std / sqrt(2 · n_layers) so the residual's variance does not grow with depth."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        if self.tok_embeddings is not None:  # None on a pipeline stage after the first
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        mtp = list(self.mtp.values()) if self.mtp is not None else []
        for module in mtp:
            nn.init.normal_(module.proj.weight, std=std)
        for block in [*self.layers.values(), *(module.block for module in mtp)]:
            attention, feed_forward = block.attention, block.feed_forward
            for weight in (
                attention.wq.weight,
                attention.wk.weight,
                attention.wv.weight,
                *feed_forward.input_weights(),
            ):
                nn.init.normal_(weight, std=std)
            nn.init.normal_(attention.wo.weight, std=out_std)
            for bias in attention.biases():  # q/k/v biases (model.attention_qkv_bias) start at 0
                nn.init.zeros_(bias)
            if attention.sinks is not None:  # drawn like the weights, as GPT-OSS initializes its sinks
                nn.init.normal_(attention.sinks.weight, std=std)
            for weight in feed_forward.output_weights():
                nn.init.normal_(weight, std=out_std)
        if self.output is not None and not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)
        for module in self.modules():
            if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
        self.scale_init_for_mup()

    @torch.no_grad()
    def scale_init_for_mup(self) -> None:
        """μP's init: each weight drawn above times its init multiplier (engine/model/mup.py), the same as
        drawing it with that std, and the same random numbers as sp; a multiplier of 0 (the untied head)
        zeroes it."""
        plan = mup_plan(self.cfg)
        if plan is None:
            return
        for name, param in self.named_parameters():
            scale = plan.params[name].init
            if scale == 0.0:
                param.zero_()
            elif scale != 1.0:
                param.mul_(scale)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())
