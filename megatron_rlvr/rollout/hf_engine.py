"""A transformers-based rollout engine: the CPU engine for CI and the numerical reference for the vLLM engine.

Batched sampling with a KV cache: the rows (prompt x sample) of a batch are left-padded to a common length, one
prefill forward per distinct prompt fills a ``DynamicCache`` (repeated for the prompt's samples), then each step
feeds one token per row; rows that finished leave the batch. Position ids are computed from the
attention mask so left padding does not shift RoPE positions: a row's logits equal those of an unpadded forward of
the same tokens up to float rounding (checked in tests/unit/test_rollout_engine.py against a full forward, 1e-5 in
fp32).

Sampling (see :mod:`megatron_rlvr.rollout.engine` for the log-prob convention): the temperature-scaled logits are
top-k / top-p filtered, then a token is drawn with the exponential-race trick ``argmax(p / q), q ~ Exp(1)``, which
samples exactly from p and lets every row own a ``torch.Generator`` seeded from (request seed, prompt index, sample
index): the samples do not depend on how rows are batched.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from megatron_rlvr.families.table import vl_family_of, vl_saved_name
from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.models.mapping import FP32_HF_TENSORS, unfuse_experts
from megatron_rlvr.models.mrope import image_token_counts, rope_index
from megatron_rlvr.rollout.engine import (
    Completion,
    GenerationStopped,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    prompt_keys_or_default,
    sample_seed,
    validate_images,
    validate_prompts,
)
from megatron_rlvr.rollout.weight_check import digest

ROUTER_BIAS_BUFFER = "mlp.gate.e_score_correction_bias"
"""transformers' name of the DeepSeek-V3 router's expert bias, a buffer it saves and loads like a weight."""


@dataclass
class HFEngineConfig:
    """Settings of the transformers engine."""

    max_batch_rows: int = 64
    """Most rows (prompt x sample) decoded together; more rows are processed in consecutive chunks."""
    device: str = "cpu"
    """Device of the model ('cpu', 'cuda', 'cuda:1')."""
    return_routes: bool = False
    """Mixture-of-experts models: record the top-k experts every router chose for every token the engine ran
    (``Completion.routes``) and their gate weights (``Completion.route_weights``), for routing replay R3."""

    def __post_init__(self):
        if not isinstance(self.max_batch_rows, int) or self.max_batch_rows < 1:
            raise ValueError(f"HFEngineConfig.max_batch_rows must be a positive int, got {self.max_batch_rows!r}")
        torch.device(self.device)  # raises on a malformed device string


def filter_logits(scaled_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of temperature-scaled logits [B, V]: removed entries become -inf.

    Top-p keeps the smallest prefix of the tokens sorted by probability whose mass reaches ``top_p`` (a token is
    removed when the mass of the tokens ranked above it is already >= top_p), so the most likely token always stays.
    Same rule as vLLM's ``apply_top_k_top_p`` (vllm 0.33.0)."""
    out = scaled_BV
    V = out.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_above >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


_NOISE_BUDGET = 1 << 22
"""Floats of sampling noise drawn ahead (B rows x steps x V); 16 MiB."""


def _cache_kwarg(model) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (deprecated alias until 5.40); support both.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFRolloutEngine(RolloutEngine):
    """Rollout engine on a ``transformers`` causal-LM (Llama, Qwen2, Qwen3, ... any model with a KV cache).

    ``tokenizer`` is optional: anything with ``decode(ids, skip_special_tokens=True) -> str``; it is needed for stop
    strings and fills ``Completion.text``. EOS ids default to the model's generation config / config.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        config: HFEngineConfig | None = None,
        eos_token_ids=None,
        image_processor=None,
    ):
        self.config = config or HFEngineConfig()
        # vision-language models: the processor that expands each image placeholder and gives the tower its input
        self.image_processor = image_processor
        self._vl = vl_family_of(model.config.to_dict())
        self.image_token_id = getattr(model.config, "image_token_id", None) if self._vl else None
        self._merge = int(model.config.vision_config.spatial_merge_size) if self._vl else 1
        self.device = torch.device(self.config.device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        if eos_token_ids is None:
            gen = getattr(self.model, "generation_config", None)
            eos_token_ids = getattr(gen, "eos_token_id", None)
            if eos_token_ids is None:
                eos_token_ids = getattr(self.model.config, "eos_token_id", None)
        if eos_token_ids is None:
            eos_token_ids = []
        elif isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self._cache_kw = _cache_kwarg(self.model)
        self._routes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._n_routers = 0
        if self.config.return_routes:
            self._n_routers = self._hook_routers()
        self._sleep_level = 0
        self._dropped_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self._weights_valid = True
        self._closed = False

    @classmethod
    def from_config(cls, hf_config, tokenizer=None, *, dtype=torch.float32, config: HFEngineConfig | None = None, **kw):
        """Build a randomly initialised model from an HF config (weights then arrive through ``update_weights``)."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if hasattr(hf_config, "vision_config") else AutoModelForCausalLM
        model = auto.from_config(hf_config, dtype=dtype)
        return cls(model, tokenizer, config=config, **kw)

    def _hook_routers(self) -> int:
        """Forward hooks on the MoE routers (transformers' ``*TopKRouter``, which return (logits, scores, indices)):
        each forward appends every router's chosen experts [tokens, k] and their gate weights [tokens, k] (the
        weights the experts' outputs are multiplied by, in the router's output dtype) to ``self._routes``, in layer
        order. The engine's own choice is recorded, not a top-k recomputed from logits (ties could resolve
        differently)."""
        # Qwen2/3-MoE: *TopKRouter; DeepSeek-V3: DeepseekV3TopkRouter (indices chosen with the expert bias, weights
        # from the unbiased sigmoid scores, renormalised and scaled); GLM-4.5: Glm4MoeTopkRouter (the same);
        # GPT-OSS: GptOssTopKRouter (top-k of the logits with the router bias, softmax over the k)
        routers = [m for m in self.model.modules() if type(m).__name__.lower().endswith("topkrouter")]
        if not routers:
            raise ValueError("HFEngineConfig.return_routes: the model has no mixture-of-experts router")

        def hook(module, inputs, output):
            self._routes.append((output[2].detach(), output[1].detach()))

        for r in routers:
            r.register_forward_hook(hook)
        return len(routers)

    def _take_routes(self, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routes of the last forward as [MoE layers, b, s, k] int16 and their gate weights [MoE layers, b, s, k]
        float32 (None when not recording)."""
        if not self._n_routers:
            return None
        if len(self._routes) != self._n_routers:
            raise RuntimeError(f"expected {self._n_routers} router calls in a forward, saw {len(self._routes)}")
        idx = torch.stack([r.reshape(b, s, -1) for r, _ in self._routes]).to("cpu", torch.int16)
        weights = torch.stack([w.reshape(b, s, -1) for _, w in self._routes]).to("cpu", torch.float32)
        self._routes.clear()
        return idx, weights

    # -- weights ---------------------------------------------------------------------------------------------------
    def named_parameters(self):
        """(HF name, parameter) for every parameter, tied aliases included (e.g. lm_head.weight). Vision-language
        models: the names their checkpoint holds (transformers nests them differently in memory)."""
        pairs = self.model.named_parameters(remove_duplicate=False)
        # DeepSeek-V3's router bias is a buffer in transformers, a weight of the checkpoint (and of the stream)
        bias = [(n, b) for n, b in self.model.named_buffers() if n.endswith(ROUTER_BIAS_BUFFER)]
        pairs = itertools.chain(pairs, bias) if bias else pairs
        if self._vl is None:
            return pairs
        return ((vl_saved_name(self._vl[1], n), p) for n, p in pairs)

    def _weights_by_name(self) -> dict[str, torch.Tensor]:
        """What the weight stream writes, by HF name: every parameter (routed experts by hub name, views of
        transformers 5's fused tensors) and the buffers a checkpoint holds (the fp32 router score-correction bias of
        DeepSeek-V3 / GLM-4.5, megatron's ``router.expert_bias``)."""
        out = unfuse_experts(dict(self.named_parameters()))
        for name, buf in self.model.named_buffers():
            if name.endswith(FP32_HF_TENSORS):
                out[vl_saved_name(self._vl[1], name) if self._vl is not None else name] = buf
        return out

    @torch.no_grad()
    def update_weights(self, weights: Iterable, strict: bool = True) -> int:
        """Copy full HF-named tensors into the parameters in place.

        ``weights`` yields (name, tensor) pairs or buckets (lists of pairs, as produced by the weight stream). A name
        may be any alias of a tied parameter, but each parameter must arrive at most once; with ``strict`` every
        parameter must arrive (ValueError naming the missing ones). Returns the number of tensors loaded."""
        self._check_open()
        if self._sleep_level:
            raise RuntimeError("update_weights called while the engine sleeps: call wake_up() first")
        # transformers 5 fuses a layer's routed experts into one tensor; the weight stream sends hub-style per-expert
        # names, which land in views of it (one view object per name, so ``received`` tracks each expert)
        params = self._weights_by_name()
        received: set[int] = set()
        count = 0
        for item in weights:
            with native_torch():  # in-place copies into a CPU model (or a CUDA one, where there are no shims)
                count += self._load_pairs(item if isinstance(item, list) else [item], params, received)
            del item  # drop the bucket before pulling the next one: the stream's memory bound relies on it
        if strict:
            missing = [n for n, p in params.items() if id(p) not in received]
            if missing:
                raise ValueError(f"update_weights: {len(missing)} parameters were not sent, e.g. {missing[:5]}")
        if strict:  # a complete update makes weights dropped by sleep(level=2) valid again
            self._weights_valid = True
        return count

    supports_weight_digests = True
    interruptible = True

    def weight_digests(self, names: Iterable[str]) -> dict[str, int]:
        """Digests of the parameters held under ``names`` (any alias of a tied parameter; experts by hub name)."""
        self._check_open()
        params = self._weights_by_name()
        with native_torch():
            return {n: digest(params[n]) for n in names if n in params}

    @staticmethod
    def _load_pairs(pairs, params: dict, received: set[int]) -> int:
        for name, tensor in pairs:
            p = params.get(name)
            if p is None:
                raise ValueError(f"update_weights: unknown parameter name {name!r} (not in the HF model)")
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(p.shape)}"
                )
            if id(p) in received:
                raise ValueError(f"update_weights: {name!r} (or a tied alias of it) was sent twice")
            p.copy_(tensor)
            received.add(id(p))
        return len(pairs)

    # -- memory ----------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Level 1: move the weights to host memory (a no-op when the model already lives on the CPU). Level 2: free
        the weights entirely (their storage is released); after ``wake_up`` they hold garbage until a full
        ``update_weights``."""
        self._check_open()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._sleep_level:
            return
        if level == 1:
            if self.device.type != "cpu":
                self.model.to("cpu")
                torch.cuda.empty_cache()
        else:
            self._dropped_shapes = {}
            for name, p in self.model.named_parameters():
                self._dropped_shapes[name] = (p.shape, p.dtype)
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._weights_valid = False
        self._sleep_level = level

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Retake the weights' memory (this engine has no KV cache to hold apart: ``tags`` wake everything)."""
        self._check_open()
        if self._sleep_level == 1 and self.device.type != "cpu":
            self.model.to(self.device)
        elif self._sleep_level == 2:
            for name, p in self.model.named_parameters():
                shape, dtype = self._dropped_shapes[name]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
            self._dropped_shapes = None
        self._sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def close(self) -> None:
        if not self._closed:
            self.model = None
            self._closed = True

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the engine is closed")

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
        images: Sequence[Sequence] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[RolloutOutput]:
        """As :meth:`RolloutEngine.generate`; ``should_stop`` is asked before every decode step, and when it returns
        True generation is abandoned with :class:`GenerationStopped` (a stop signal must not wait for the batch)."""
        self._check_open()
        if self._sleep_level:
            raise RuntimeError("generate called while the engine sleeps: call wake_up() first")
        if not self._weights_valid:
            raise RuntimeError("weights were dropped by sleep(level=2): call update_weights before generate")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs an engine tokenizer")
        prompts = validate_prompts(prompts, self.vocab_size)
        images = validate_images(images, prompts, self.image_token_id)
        vision: list[tuple | None] = [None] * len(prompts)
        if images is not None:
            if self.image_processor is None:
                raise ValueError("images were given but the transformers engine has no image processor")
            for i, ims in enumerate(images):
                if ims:
                    prompts[i], vision[i] = self._expand(prompts[i], ims)
        keys = prompt_keys_or_default(prompt_keys, len(prompts))
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        outputs = [RolloutOutput(prompt_token_ids=list(p), completions=[None] * params.n) for p in prompts]
        step = self.config.max_batch_rows
        with native_torch():  # transformers makes no CUDA calls for a CPU model: skip the CPU shims' handler
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                seeds = [sample_seed(base_seed, keys[i], j) for i, j in chunk]
                rows_vision = [None if vision[i] is None else (i, *vision[i]) for i, _ in chunk]
                comps = self._generate_rows([prompts[i] for i, _ in chunk], seeds, params, rows_vision, should_stop)
                for (i, j), comp in zip(chunk, comps):
                    outputs[i].completions[j] = comp
        return outputs

    def _expand(self, prompt: list[int], images: list) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
        """(the prompt with each image's one placeholder expanded to its merged patches, (pixel_values [n_patches,
        D], image_grid_thw [n_images, 3]))."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        pixels, grid = out["pixel_values"], out["image_grid_thw"]
        counts = iter(image_token_counts(grid, self._merge))
        ids: list[int] = []
        for tok in prompt:
            ids.extend([tok] * next(counts) if tok == self.image_token_id else [tok])
        return ids, (pixels.to(self.model.dtype), grid)

    @torch.no_grad()
    def _forward(self, input_ids, attention_mask, position_ids, cache, **vision):
        """Last-position logits [B, V] fp32 and, when recording, the routes and gate weights [MoE layers, B, S, k]
        (``_take_routes``). ``vision``: the prompt forward's pixel_values and image_grid_thw (vision-language
        models)."""
        self._routes.clear()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
            **vision,
        )
        return out.logits[:, -1, :].float(), self._take_routes(*input_ids.shape)

    def _prefill(self, prompts: list[list[int]], vision: list):
        """The prompts' prefill, each distinct prompt once: the KV cache, the last logits, the attention mask and
        the next positions of every row, and each row's prompt routes (R3; None without routes)."""
        from transformers import DynamicCache  # transformers' import costs seconds: only once generating

        B, dev = len(prompts), self.device
        # The n samples of a prompt share its prefill: one forward per distinct prompt, whose cache rows, logits and
        # mask are then repeated for each of its rows (a row's values do not depend on its batch neighbours). Prompts
        # with images are distinct per prompt index (equal tokens may carry other images).
        distinct: dict[tuple, int] = {}
        row_of = [
            distinct.setdefault((tuple(p), None if v is None else v[0]), len(distinct)) for p, v in zip(prompts, vision)
        ]
        uniq = [p for p, _ in distinct]
        uniq_vision = [None] * len(uniq)
        for r, v in zip(row_of, vision):
            uniq_vision[r] = v
        L = max(len(p) for p in uniq)
        input_ids = torch.zeros(len(uniq), L, dtype=torch.long, device=dev)
        mask = torch.zeros(len(uniq), L, dtype=torch.long, device=dev)
        for r, p in enumerate(uniq):  # left padding: the last column is every row's newest token
            input_ids[r, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, L - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        extra = {}
        if self._vl is not None:  # M-RoPE: 3-D positions of the prompts, images in their rows' order
            positions = positions[None].repeat(3, 1, 1)
            for r, (p, v) in enumerate(zip(uniq, uniq_vision)):
                if v is not None:
                    ids = torch.tensor(p, dtype=torch.long)
                    positions[:, r, L - len(p) :] = rope_index(ids == self.image_token_id, v[2], self._merge).to(dev)
            with_images = [v for v in uniq_vision if v is not None]
            if with_images:
                extra = dict(
                    pixel_values=torch.cat([v[1] for v in with_images]).to(dev),
                    image_grid_thw=torch.cat([v[2] for v in with_images]).to(dev),
                )
        cache = DynamicCache(config=self.model.config)
        logits, routes = self._forward(input_ids, mask, positions, cache, **extra)
        # the next token's position: one past the largest of the prompt (text after an image continues from there)
        next_pos = (positions.amax(dim=(0, 2)) + 1)[:, None] if positions.dim() == 3 else positions[:, -1:] + 1
        # R3: each row's routes, the prompt's real (unpadded) positions, then one position per token fed back
        prompt_routes = [
            None if routes is None else tuple(x[:, row_of[b], L - len(prompts[b]) :] for x in routes) for b in range(B)
        ]
        if len(uniq) < B:  # DynamicCache.batch_select_indices (transformers >= 4.51) also repeats rows
            expand = torch.tensor(row_of, dtype=torch.long, device=dev)
            cache.batch_select_indices(expand)
            logits, mask, next_pos = logits[expand], mask[expand], next_pos[expand]
        return cache, logits, mask, next_pos, prompt_routes

    @torch.no_grad()
    def _generate_rows(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        vision: list | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Completion]:
        """``vision``: per row None or (prompt index, pixel_values, image_grid_thw) of its images."""
        B, dev = len(prompts), self.device
        cache, logits, mask, next_pos, prompt_routes = self._prefill(prompts, vision or [None] * B)
        step_routes: list[list[torch.Tensor]] = [[] for _ in range(B)]

        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        stop_ids = set(params.stop_token_ids)
        end_ids = stop_ids | (set() if params.ignore_eos else set(self.eos_token_ids))
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        done: list[Completion | None] = [None] * B
        T = params.temperature if not params.greedy else 1.0
        # Exponential-race noise (argmax p / q, q ~ Exp(1), is a sample of p), drawn for `chunk` steps at once per
        # row: a generator's stream is sequential, so q[r, k] is bit-identical to drawing V values per step, while
        # the calls drop from B per step to B per chunk (the chunk bounds the buffer at ~_NOISE_BUDGET floats).
        chunk = max(1, min(params.max_tokens, _NOISE_BUDGET // max(1, B * logits.shape[-1])))
        noise = None
        # Rows still decoding, as indices into the B rows: finished rows leave the batch (their cache rows, mask and
        # positions are dropped), so a decode step's work follows the rows still running, not the longest one.
        alive = list(range(B))
        alive_t = torch.arange(B, device=dev)
        for step in range(params.max_tokens):
            if should_stop is not None and should_stop():
                raise GenerationStopped("generation stopped: a stop was requested")
            scaled = logits / T
            logp_full = torch.log_softmax(scaled, dim=-1)
            if params.greedy:
                chosen = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
                if step % chunk == 0:
                    noise = torch.ones(B, chunk, probs.shape[-1], dtype=probs.dtype, device=dev)
                    for r in alive:  # finished rows have left `alive`: their generators are never read again
                        noise[r].exponential_(generator=gens[r])
                chosen = torch.argmax(probs / noise[alive_t, step % chunk], dim=-1)
            chosen_lp = logp_full.gather(-1, chosen[:, None])[:, 0].tolist()
            chosen_l = chosen.tolist()
            for pos, r in enumerate(alive):  # every row in `alive` is still running at this step
                tok = chosen_l[pos]
                toks[r].append(tok)
                lps[r].append(chosen_lp[pos])
                done[r] = self._check_finished(toks[r], lps[r], tok, stop_ids, end_ids, params)
            if all(d is not None for d in done) or step == params.max_tokens - 1:
                break
            if any(done[r] is not None for r in alive):
                keep = [pos for pos, r in enumerate(alive) if done[r] is None]
                keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(keep_t)
                mask, next_pos, chosen = mask[keep_t], next_pos[keep_t], chosen[keep_t]
                alive = [alive[pos] for pos in keep]
                alive_t = torch.tensor(alive, dtype=torch.long, device=dev)
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype, device=dev)], dim=1)
            logits, routes = self._forward(chosen[:, None], mask, next_pos, cache)
            if routes is not None:
                for pos, r in enumerate(alive):
                    step_routes[r].append(tuple(x[:, pos, :1] for x in routes))
            next_pos = next_pos + 1
        if self._n_routers:  # [MoE layers, P + R - 1, k]: the last generated token was never fed back
            for r, comp in enumerate(done):
                comp.routes, comp.route_weights = (
                    torch.cat([prompt_routes[r][j], *(x[j] for x in step_routes[r])], dim=1) for j in (0, 1)
                )
        return done

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _check_finished(self, ids, lps, tok, stop_ids, end_ids, params: SamplingParams) -> Completion | None:
        """A finished Completion for this row, or None while it goes on. Order as in vLLM: stop token, stop string,
        then length."""
        text = None
        if tok in end_ids:
            reason = tok if tok in stop_ids else None
            text = self._decode(ids) if self.tokenizer is not None else None
            return Completion(list(ids), list(lps), "stop", reason, text)
        if params.stop:
            text = self._decode(ids)
            hits = [(text.find(s), s) for s in params.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                cut = pos + len(s) if params.include_stop_str_in_output else pos
                return Completion(list(ids), list(lps), "stop", s, text[:cut])
        if len(ids) >= params.max_tokens:
            if text is None and self.tokenizer is not None:
                text = self._decode(ids)
            return Completion(list(ids), list(lps), "length", None, text)
        return None
