"""The layout planner's memory model: layout validation and per-GPU memory of every pipeline stage (see the
package docstring for the formulas' sources). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlvr.config.lora_config import LoRAConfig
from megatron_rlvr.config.sections import ClusterConfig, ParallelConfig, RolloutConfig, TrainConfig
from megatron_rlvr.families.table import ModelSpec

GIB = 1024**3

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per element of each ``model.dtype``."""


class LayoutError(ValueError):
    """The requested parallel layout cannot run (a size does not divide, an axis is too large)."""


@dataclass
class PlanConfig:
    """What the memory model reads: a model's shapes plus the run config's own sections (no copies of them)."""

    model: ModelSpec
    """The model to plan for."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout (sequence_parallel None: on when tp > 1, as on GPUs)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout lengths and the vLLM engine's memory share."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Micro-batch tokens, recompute, logits chunk."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Allocation and memory assumptions."""
    ref_model: bool | None = None
    """Whether a reference model is kept; None: train.ref_model (the run config resolves it from the algorithm)."""
    teacher: ModelSpec | None = None
    """The distillation teacher (``algorithm.distill.teacher``): a frozen model at the policy's TP / PP layout in
    the policy's dtype (its weights on every training GPU); None: no distillation."""
    teacher_logits: bool = False
    """The teacher's logits shard [micro_batch_tokens, V/tp] sits beside the policy's in every training forward
    (``algorithm.distill.estimator=full``)."""
    lora: LoRAConfig | None = None
    """model.lora: frozen base weights (no gradients, no optimizer state, the reference is the base itself);
    gradients and Adam states for the adapters only."""
    dtype: str = "bfloat16"
    """Parameter dtype (the run's ``model.dtype``): weights, activations, logits, the reference model and the
    rollout engine's weights and KV cache are held in it; float32 also drops the separate fp32 master weights."""
    vision_trainable: bool = True
    """A vision-language model's tower is trained (gradients, Adam state, stored activations) rather than frozen
    (weights only; it runs without autograd). Ignored for text models; LoRA runs keep the tower frozen."""
    image_token_fraction: float | None = None
    """Vision-language models: the share of a micro-batch's tokens that are image tokens, which sets how many
    patches (``spatial_merge_size``^2 per image token) the tower sees per micro-batch. None: the prompt share of
    the longest sequence, ``max_prompt_len / (max_prompt_len + max_response_len)`` (as if every prompt token were an
    image token: an upper bound when sequences are packed in that proportion)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model.dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        f = self.image_token_fraction
        if f is not None and not (isinstance(f, (int, float)) and 0.0 <= f <= 1.0):
            raise ValueError(f"image_token_fraction must be a number in [0, 1] or None, got {f!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def engine(self) -> str:
        """The rollout engine planned: ``rollout.engine``, ``auto`` being vLLM (its choice on a CUDA machine with
        vLLM installed, which is what a plan is for)."""
        return "vllm" if self.rollout.engine == "auto" else self.rollout.engine

    @property
    def micro_batch_tokens(self) -> int:
        return self.train.micro_batch_tokens or self.max_model_len

    @property
    def max_model_len(self) -> int:
        return self.rollout.max_prompt_len + self.rollout.max_response_len

    @property
    def image_patches_per_micro_batch(self) -> int:
        """Patches the vision tower sees per micro-batch (0 for a text model): image tokens x merge^2."""
        v = self.model.vision
        if v is None:
            return 0
        frac = self.image_token_fraction
        if frac is None:
            frac = self.rollout.max_prompt_len / self.max_model_len
        return int(self.micro_batch_tokens * frac) * v.spatial_merge_size**2

    @property
    def trains_vision(self) -> bool:
        """The tower is trained: a VL model, ``vision_trainable``, and not a LoRA run."""
        return self.model.vision is not None and self.vision_trainable and self.lora is None

    @property
    def keeps_ref_model(self) -> bool:
        return bool(self.train.ref_model if self.ref_model is None else self.ref_model)

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel_on(cuda=True)


# ----------------------------------------------------------------------------------------------------------------
# Layout validation
# ----------------------------------------------------------------------------------------------------------------


def validate_layout(model: ModelSpec, par: ParallelConfig, world_size: int, gpus_per_node: int = 8):
    """(errors, warnings) for this layout; an empty error list means Megatron and vLLM can both build it. With
    ``parallel.rollout_ranks`` R > 0 (disaggregated) TP x PP must divide the world - R training ranks and the
    rollout TP the R rollout ranks.

    Megatron-Core (TransformerConfig.__post_init__, core 0.16): num_attention_heads % tp == 0, and
    num_query_groups must be a multiple OR a divisor of tp; when kv_heads < tp each KV head is replicated on
    tp / kv_heads ranks (the fused QKV output is all-gathered and sliced, attention.py). The trainer's weight mapping
    does not replicate key/value heads, so the training TP must divide them (``config.run.check_layout``, same
    words). vLLM's QKVParallelLinear replicates them: the rollout TP may also be a multiple (replicas =
    rollout_tp / kv_heads).
    """
    errors: list[str] = []
    warnings: list[str] = []
    # disaggregated (parallel.rollout_ranks > 0): the first world - R ranks train, the last R run the engines
    R = par.rollout_ranks
    if R and R >= world_size:
        errors.append(f"parallel.rollout_ranks={R} leaves no training rank in a world of {world_size}")
        return errors, warnings
    engine_world = R or world_size
    world_size -= R
    for axis, t in (("tp", par.tp), ("rollout_tp", par.rollout_tp)):
        if model.heads % t:
            errors.append(f"parallel.{axis}={t} does not divide the {model.heads} attention heads")
        if axis == "tp" and model.kv_heads % t:
            # the trainer's check (config.run.check_layout): models.mapping splits key/value heads over TP and never
            # copies them, so the megatron-core rule that replicates them when tp % kv_heads == 0 is not available
            errors.append(
                f"parallel.tp={t} does not divide the model's num_key_value_heads={model.kv_heads}: choose a "
                f"parallel.tp that divides {model.kv_heads} (parallel.rollout_tp may still be larger: vLLM "
                "replicates key/value heads)"
            )
        elif model.kv_heads % t and t % model.kv_heads:
            errors.append(
                f"parallel.{axis}={t} and the {model.kv_heads} KV heads: one must divide the other "
                f"(KV heads are split when kv_heads % tp == 0, replicated when tp % kv_heads == 0)"
            )
        if model.ffn % t:
            errors.append(f"parallel.{axis}={t} does not divide ffn={model.ffn} (column-parallel MLP)")
        if t > gpus_per_node:
            warnings.append(f"parallel.{axis}={t} spans nodes ({gpus_per_node} GPUs/node): TP traffic leaves NVLink")
    if model.layers % par.pp:
        errors.append(f"parallel.pp={par.pp} does not divide the {model.layers} layers")
    if par.cp > 1 and (model.vision is not None or model.is_moe or model.mla is not None):
        errors.append(f"parallel.cp={par.cp}: context parallelism is for dense text models (use parallel.cp=1)")
    heads_tp, kv_tp = model.heads // par.tp, model.kv_heads // par.tp
    if par.cp > 1 and par.cp_comm_type == "a2a" and (heads_tp % par.cp or kv_tp % par.cp):
        errors.append(
            f"parallel.cp_comm_type=a2a: parallel.cp={par.cp} must divide the {heads_tp} attention and {kv_tp} "
            "key/value heads per TP rank (use p2p or all_gather)"
        )
    mp = par.tp * par.cp * par.pp
    what = f"training ranks {world_size} (world - rollout_ranks)" if R else f"world size {world_size}"
    grid = f"tp x cp x pp = {par.tp} x {par.cp} x {par.pp}" if par.cp > 1 else f"tp x pp = {par.tp} x {par.pp}"
    if world_size % mp:
        errors.append(f"{what} is not divisible by {grid} = {mp}")
    if engine_world % par.rollout_tp:
        where = f"parallel.rollout_ranks={R}" if R else f"world size {engine_world}"
        errors.append(f"{where} is not divisible by rollout_tp={par.rollout_tp}")
    if world_size < mp:
        errors.append(f"{what} is smaller than {grid} = {mp}")
    expert_layout_errors(model, par, world_size, errors)
    return errors, warnings


def expert_layout_errors(model: ModelSpec, par: ParallelConfig, world_size: int, errors: list[str]) -> None:
    """Megatron's expert grid (etp x ep x expert-dp x pp = world, parallel_state.initialize_model_parallel): EP splits
    whole experts, expert TP an expert's inner width; ep / etp > 1 need an MoE model."""
    etp = par.expert_tp
    if not model.is_moe:
        if par.ep > 1 or (par.etp or 1) > 1:
            errors.append("parallel.ep / parallel.etp > 1 need a mixture-of-experts model")
        return
    if model.experts % par.ep:
        errors.append(f"parallel.ep={par.ep} does not divide the {model.experts} routed experts")
    if model.expert_ffn % etp:
        errors.append(f"expert TP {etp} does not divide the experts' inner width {model.expert_ffn}")
    if model.linear_bias and etp != 1:  # the model build's check (models.hf_config); etp unset means etp = tp
        errors.append(f"expert tensor parallel size {etp}: GPT-OSS's expert biases need expert TP 1 (parallel.etp=1)")
    if world_size % (etp * par.ep * par.pp):
        errors.append(
            f"world size {world_size} is not divisible by etp x ep x pp = {etp} x {par.ep} x {par.pp} (the experts' "
            "grid)"
        )


# ----------------------------------------------------------------------------------------------------------------
# Memory estimate
# ----------------------------------------------------------------------------------------------------------------


def _stage_moe_layers(model: ModelSpec, pp: int) -> list[int]:
    """MoE layers on each pipeline stage (stage s holds layers [s L/pp, (s+1) L/pp))."""
    n_local = model.layers // pp
    if not model.is_moe:
        return [0] * pp
    return [sum(model.moe_layers[s * n_local : (s + 1) * n_local]) for s in range(pp)]


def stage_expert_params(model: ModelSpec, par: ParallelConfig) -> list[int]:
    """Routed-expert parameters held by ONE GPU of each pipeline stage: per MoE layer E/ep experts, each 3 h f_e
    split over expert TP (the part the distributed optimizer shards over the expert-data-parallel group)."""
    per_layer = model.moe_layer_params()["experts"] // par.ep // par.expert_tp
    return [n * per_layer for n in _stage_moe_layers(model, par.pp)]


def stage_params(model: ModelSpec, par: ParallelConfig) -> list[int]:
    """Parameters held by ONE GPU of each pipeline stage (TP-sharded matrices, replicated norms, padded vocab).

    Stage 0 holds the input embedding, the last stage the final norm and the LM head (with tied embeddings and
    pp > 1 Megatron keeps a copy of the embedding on the last stage for the output layer). An MoE layer holds its
    attention (TP-sharded), the router [E, h] (replicated), the shared expert (TP-sharded) and E/ep routed experts
    split over expert TP (``stage_expert_params``) instead of the dense MLP.
    """
    lp = model.layer_params()
    per_layer = (lp["qkv_w"] + lp["qkv_b"] + lp["out_w"] + lp["mlp_w"]) // par.tp + lp["norms"] + lp["attn_rep"]
    mp = model.moe_layer_params()
    per_moe_layer = per_layer - lp["mlp_w"] // par.tp + mp["router"] + mp["shared"] // par.tp
    emb = model.padded_vocab(par.tp) * model.hidden // par.tp
    n_local = model.layers // par.pp
    experts = stage_expert_params(model, par)
    out = []
    for s, n_moe in enumerate(_stage_moe_layers(model, par.pp)):
        n = (n_local - n_moe) * per_layer + n_moe * per_moe_layer + experts[s]
        if s == 0:
            n += emb
        if s == par.pp - 1:
            n += model.hidden  # final norm
            if not model.tied_embeddings or par.pp > 1:
                n += emb
        out.append(n)
    return out


def lora_stage_params(model: ModelSpec, par: ParallelConfig, lora: LoRAConfig) -> list[int]:
    """Adapter parameters held by ONE GPU of each pipeline stage (models/lora.py's layout: a column-parallel
    target keeps A [P*r, in] whole and B [out/tp, r]; a row-parallel one A [r, in/tp] and B [out, r] whole; P is
    3 for the fused qkv, 2 for a gated fc1; MLA's replicated down projections A [r, in] and B [out, r] whole)."""
    r, h, f = lora.rank, model.hidden, model.ffn
    qkv_out = model.q_dim + 2 * model.kv_dim
    gates = 2 if model.gated_mlp else 1
    per_target = {
        "qkv": 3 * r * h + qkv_out * r // par.tp,
        "proj": r * model.q_dim // par.tp + h * r,
        "fc1": gates * r * h + gates * f * r // par.tp,
        "fc2": r * f // par.tp + h * r,
    }
    m = model.mla
    if m is not None:
        # the down projections (q_a, kv_a) are whole on every TP rank, A and B too; the up projections are
        # column-parallel by heads, o_proj row-parallel over heads x v_head_dim
        q_in = m.q_lora_rank or h
        per_target = {
            "q_a": r * h + (m.q_lora_rank or 0) * r,
            "q_b": r * q_in + model.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * r // par.tp,
            "kv_a": r * h + (m.kv_lora_rank + m.qk_rope_head_dim) * r,
            "kv_b": r * m.kv_lora_rank + model.heads * (m.qk_nope_head_dim + m.v_head_dim) * r // par.tp,
            "proj": r * model.heads * m.v_head_dim // par.tp + h * r,
            "fc1": per_target["fc1"],
            "fc2": per_target["fc2"],
        }
        if not m.q_lora_rank:  # no query down projection (q_b is q_proj)
            del per_target["q_a"]
    bad = [t for t in lora.targets if t not in per_target]
    if bad:
        kind = "multi-latent attention" if m is not None else "this model's attention"
        raise ValueError(f"lora.targets: {bad} do not exist on {kind}; choose among {sorted(per_target)}")
    per_layer = sum(per_target[t] for t in lora.targets)
    return [model.layers // par.pp * per_layer] * par.pp


def activation_bytes_per_layer(
    model: ModelSpec, tokens: int, tp: int, sequence_parallel: bool, dtype_bytes: int = 2
) -> int:
    """Bytes of activations one transformer layer saves for backward, for `tokens` tokens of one micro-batch, in a
    dtype of ``dtype_bytes`` bytes (2: bf16, as below; 4: fp32 doubles every term).

    Korthikanti et al. 2022 (Sec. 4.1) count 34 s*b*h + 5 a s^2 b per layer for GPT (GeLU, MHA, dropout,
    materialised softmax). Re-derived here for Llama/Qwen layers trained with flash attention and no dropout
    (per token, 2 bytes per element):
        RMSNorm inputs            2h + 2h
        QKV input, MLP input      2h + 2h
        Q; K and V (GQA)          2 q_dim; 4 kv_dim       (flash attention keeps q, k, v; no s^2 term)
        attention output          2 q_dim                 (input of the output projection)
        SwiGLU                    4f (fc1 output, gate|up) + 2f (input of fc2)
    = 8h + 4 q_dim + 4 kv_dim + 6f. With sequence parallelism every term is sharded over TP (Sec. 4.2.2);
    without it the 8h norm/linear-input terms are replicated and only the rest is divided by TP.
    Check against the paper: a GPT layer (MHA so q_dim = kv_dim = h, f = 4h, GeLU MLP storing 2f + 2f bytes)
    gives 8h + 4h + 4h + 16h = 32h, the paper's 34 s*b*h minus its two s*b*h dropout masks.
    """
    h, f = model.hidden, model.ffn
    b = dtype_bytes
    replicated = 4 * h * b
    sharded = (model.attn_activation_width() + (3 * f if model.gated_mlp else 2 * f)) * b
    if sequence_parallel:
        return tokens * (replicated + sharded) // tp
    return tokens * (replicated + sharded // tp)


def moe_activation_bytes_per_layer(model: ModelSpec, tokens: int, tp: int, etp: int, sequence_parallel: bool) -> int:
    """Bytes one MoE layer saves for backward, for `tokens` tokens of one micro-batch: the dense layer's terms
    without its MLP (``activation_bytes_per_layer``), plus, per token (Megatron trains MoE layers with tp > 1 only
    under sequence parallelism, so every term is divided by TP then):
        router                    8E                      (fp32 logits and scores; the probs are per routed copy)
        routed copies             k (4h + 6 f_e / etp')   (each token's k routed copies: the permuted input and the
                                                           expert output, 2h + 2h, and the SwiGLU terms 6 f_e of
                                                           ONE expert, sharded over expert TP)
        shared expert             6 f_s / tp
    Only the k active experts of a token store anything: an idle expert has no activations. Balanced routing spreads
    the tp x dp x k copies of a stage's tokens evenly over its GPUs; a copy's expert runs on etp GPUs, so one GPU
    holds T k etp / tp copies with 6 f_e / etp SwiGLU bytes each: T k / tp (4h etp + 6 f_e) in all."""
    h = model.hidden
    # the dense layer's terms without the MLP: 8h replicated (unless SP), 4 q_dim + 4 kv_dim sharded
    attn_sharded = 2 * model.attn_activation_width()
    if sequence_parallel:
        attn = tokens * (8 * h + attn_sharded) // tp
    else:
        attn = tokens * (8 * h + attn_sharded // tp)
    div = tp if sequence_parallel else 1
    router = tokens * 8 * model.experts // div
    routed = tokens * model.top_k * (4 * h * etp + 6 * model.expert_ffn) // tp
    shared = tokens * 6 * model.shared_expert_ffn // tp
    return attn + router + routed + shared


_TRAIN_PHASE_TERMS = ("weights", "grads", "optimizer", "ref_model", "teacher", "activations", "logits", "logits_chunk")
_TRAIN_PHASE_TERMS += ("teacher_logits", "train_overhead", "engine_in_training")

LOGITS_CHUNK_FACTOR = 4
"""fp32 [chunk, V/tp] buffers alive at once in the vocab-parallel ops: upcast logits, exp/softmax, grad, a temp."""


@dataclass
class MemoryPlan:
    """The planner's verdict for one config on one allocation."""

    config: PlanConfig
    """The config that was planned."""
    world_size: int
    """nodes x GPUs per node."""
    dp: int
    """Data-parallel size world / (tp x cp x pp); the distributed optimizer shards over dp x cp (megatron's
    data-with-context-parallel group)."""
    errors: list[str]
    """Layout errors (the layout cannot be built); memory is not estimated when non-empty."""
    warnings: list[str]
    """Legal but slow choices (TP across nodes)."""
    reasons: list[str] = field(default_factory=list)
    """Why the layout does not fit in memory (empty when it fits)."""
    components: dict[str, float] = field(default_factory=dict)
    """Bytes per GPU of each term, for the worst pipeline stage (keys: see ``estimate_memory``)."""
    worst_stage: int = 0
    """The pipeline stage with the largest peak (reported in the table)."""
    stage_param_counts: list[int] = field(default_factory=list)
    """Parameters held by one GPU of each pipeline stage."""
    train_peak: float = 0.0
    """Bytes per GPU while training (vLLM asleep), worst stage."""
    rollout_peak: float = 0.0
    """Bytes per GPU while vLLM generates (training state resident unless offloaded), worst stage."""
    kv_tokens: int = 0
    """KV-cache capacity of one rollout engine in tokens (all layers): vLLM's pool, or the transformers engine's
    ``max_batch_rows`` full-length rows."""
    edp: int = 0
    """Expert-data-parallel size world / (etp x ep x pp): the distributed optimizer's sharding factor of the routed
    experts' state (0: a dense model)."""
    stage_expert_param_counts: list[int] = field(default_factory=list)
    """Routed-expert parameters held by one GPU of each pipeline stage (included in ``stage_param_counts``)."""
    engines: int = 0
    """Rollout engines: rollout ranks (the world when colocated) / rollout TP."""

    @property
    def disaggregated(self) -> bool:
        """parallel.rollout_ranks > 0: ``train_peak`` is a training rank's GPU, ``rollout_peak`` a rollout rank's."""
        return self.config.parallel.rollout_ranks > 0

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.config.parallel.rollout_ranks

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak)

    @property
    def limit(self) -> float:
        c = self.config.cluster
        return c.gpu_mem_gb * c.usable_fraction * GIB

    @property
    def fits(self) -> bool:
        return not self.errors and not self.reasons


def _vllm_weight_params(model: ModelSpec, rtp: int) -> int:
    """Parameters per GPU of a vLLM engine at TP=rtp; KV heads are replicated when rtp > kv_heads."""
    h, d = model.hidden, model.head_dim
    kv_local = max(1, model.kv_heads // rtp)
    q_local = model.heads // rtp
    lp = model.layer_params()
    if model.mla is not None:  # vLLM: the down projections replicated, the up projections split by heads
        qkv_w, qkv_b = lp["qkv_w"] // rtp + lp["attn_rep"], 0
    else:
        qkv_w = h * d * (q_local + 2 * kv_local)
        qkv_b = d * (q_local + 2 * kv_local) if model.qkv_bias else 0
    per_layer = qkv_w + qkv_b + (lp["out_w"] + lp["mlp_w"]) // rtp + lp["norms"]
    vocab_shard = -(-model.vocab // rtp)  # vLLM pads the vocab shard; the difference is negligible here
    emb = vocab_shard * h * (1 if model.tied_embeddings else 2)
    # vLLM shards the vision tower's linear layers over the rollout TP as well (mm_encoder_tp_mode "weights")
    emb += model.vision.param_count() // rtp if model.vision is not None else 0
    # MoE layers: every engine rank holds every routed expert, its inner width sliced by the rollout TP (vLLM's
    # FusedMoE without expert parallelism), the router replicated
    mp = model.moe_layer_params()
    per_moe_layer = per_layer - lp["mlp_w"] // rtp + mp["router"] + (mp["experts"] + mp["shared"]) // rtp
    n_moe = model.n_moe_layers
    return (model.layers - n_moe) * per_layer + n_moe * per_moe_layer + emb + h


def estimate_memory(cfg: PlanConfig) -> MemoryPlan:
    """Validate the layout and estimate per-GPU memory of every pipeline stage; keeps the worst stage.

    ``components`` keys (bytes, worst stage): weights, grads, optimizer, ref_model, teacher (the distillation
    teacher's weights), act_none, act_full, activations (the configured recompute mode), logits, logits_chunk,
    teacher_logits (the full-vocabulary distillation's teacher logits), train_overhead, engine_in_training (vLLM
    asleep, or the transformers engine's resident weights), train_state_in_rollout, engine (the rollout engine
    awake), of which engine_weights, engine_overhead, kv_cache; host_ram_per_node (vLLM sleep level 1 weight backup). A
    vision-language model's tower lives on pipeline stage 0, whole on every GPU there (a plain module beside
    Megatron, not TP-sharded): its weights, and when trained its fp32 gradients and Adam state (12 B/param, not
    sharded by the distributed optimizer) and the activations of its ``depth`` blocks for
    ``image_patches_per_micro_batch`` patches per micro-batch in flight (no recompute inside the tower), are
    included in the terms above and also reported as vision_weights, vision_state (gradients + optimizer) and
    vision_activations; a frozen tower keeps one block's activations, transiently.

    The engine is ``rollout.engine``: vLLM claims ``gpu_memory_utilization`` x GPU (or its weights + overhead +
    ``rollout.kv_cache_gb``) and sleeps while training; the transformers engine (rollout TP 1) keeps its full weights
    on the GPU throughout and, while generating, a KV cache of ``max_batch_rows`` rows of ``max_model_len`` tokens.
    """
    m, par, cl = cfg.model, cfg.parallel, cfg.cluster
    world = cl.world_size
    errors, warnings = validate_layout(m, par, world, cl.gpus_per_node)
    if cfg.teacher is not None:  # the teacher is split like the policy: TP over its heads, PP over its layers
        t_errors, _ = validate_layout(cfg.teacher, par, world, cl.gpus_per_node)
        errors += [f"distillation teacher {cfg.teacher.name}: {e}" for e in t_errors if "rollout_tp" not in e]
    # disaggregated: training ranks hold only the training state, rollout ranks only an engine (never asleep)
    R = par.rollout_ranks
    disagg = R > 0
    train_world = world - R
    dp = max(1, train_world // (par.tp * par.cp * par.pp))
    plan = MemoryPlan(config=cfg, world_size=world, dp=dp, errors=errors, warnings=warnings)
    plan.engines = max(1, (R or world) // par.rollout_tp)
    T = cfg.micro_batch_tokens
    if T < cfg.max_model_len:
        errors.append(
            f"train.micro_batch_tokens={T} is smaller than one max-length sequence "
            f"(rollout.max_prompt_len + max_response_len = {cfg.max_model_len}); a sequence cannot be split"
        )
    if errors:
        return plan

    params = stage_params(m, par)
    plan.stage_param_counts = params
    teacher_params = stage_params(cfg.teacher, par) if cfg.teacher is not None else [0] * len(params)
    lora_params = lora_stage_params(m, par, cfg.lora) if cfg.lora else [0] * len(params)
    expert_params = stage_expert_params(m, par)
    plan.stage_expert_param_counts = expert_params
    moe_per_stage = _stage_moe_layers(m, par.pp)
    edp = max(1, train_world // (par.expert_tp * par.ep * par.pp)) if m.is_moe else 1
    plan.edp = edp if m.is_moe else 0
    engine = _engine_budget(cfg)
    plan.kv_tokens = max(0, int(engine.kv_cache // engine.kv_per_token))

    best = None
    for s, p in enumerate(params):
        c = _state_terms(cfg, s, p, lora_params[s], expert_params[s], dp * par.cp, edp)
        c["teacher"] = cfg.dtype_bytes * teacher_params[s]
        c.update(_activation_terms(cfg, s, moe_per_stage[s]))
        c["train_overhead"] = cl.train_overhead_gb * GIB
        c["engine_in_training"] = engine.in_training
        train_peak = sum(c[k] for k in _TRAIN_PHASE_TERMS)
        state = c["weights"] + c["grads"] + c["optimizer"] + c["ref_model"] + c["teacher"]
        c["train_state_in_rollout"] = 0 if (cl.offload_during_rollout or disagg) else state
        c["engine"] = engine.total
        c["engine_weights"] = engine.weights
        c["engine_overhead"] = engine.overhead
        c["kv_cache"] = engine.kv_cache
        rollout_peak = c["train_state_in_rollout"] + engine.total + c["train_overhead"]
        if best is None or max(train_peak, rollout_peak) > max(best[1], best[2]):
            best = (s, train_peak, rollout_peak, c)
    s, plan.train_peak, plan.rollout_peak, plan.components = best
    plan.worst_stage = s
    # level-1 sleep backs the weights up in host RAM; a disaggregated engine never sleeps
    sleeps_to_host = cfg.engine == "vllm" and cfg.rollout.sleep_level == 1 and not disagg
    plan.components["host_ram_per_node"] = engine.weights * cl.gpus_per_node if sleeps_to_host else 0
    plan.reasons.extend(_misfit_reasons(plan, engine))
    return plan


@dataclass
class _EngineBudget:
    """Bytes per GPU of one rollout engine's rank."""

    weights: float
    """The engine's copy of the model weights."""
    overhead: float
    """vLLM's fixed overhead (CUDA graphs, workspace); 0 for the transformers engine."""
    kv_cache: float
    """The KV cache (negative when vLLM's share does not even hold its weights)."""
    total: float
    """Everything the awake engine holds."""
    in_training: float
    """What stays on a colocated GPU while training: vLLM asleep, or the transformers engine's weights."""
    kv_per_token: int
    """K and V of one token over all layers."""


def _engine_budget(cfg: PlanConfig) -> _EngineBudget:
    """The rollout engine's memory: vLLM claims ``gpu_memory_utilization`` x GPU (or weights + overhead +
    ``rollout.kv_cache_gb``) and sleeps while training; the transformers engine keeps its weights throughout and a
    cache of ``max_batch_rows`` full-length rows."""
    m, par, ro, cl = cfg.model, cfg.parallel, cfg.rollout, cfg.cluster
    b = cfg.dtype_bytes
    disagg = par.rollout_ranks > 0
    # K and V for every layer in the model dtype; an engine keeps max(1, kv_heads / rollout_tp) heads per GPU.
    # K and V for every layer in the model dtype; an engine keeps max(1, kv_heads / rollout_tp) heads per GPU
    # (multi-latent attention: the latent and the RoPE key, on every GPU)
    kv_per_token = m.kv_cache_elems_per_token(par.rollout_tp) * b
    if cfg.engine == "vllm":
        weights = b * _vllm_weight_params(m, par.rollout_tp)
        overhead = cl.vllm_overhead_gb * GIB
        if ro.kv_cache_gb is not None:  # vLLM sizes its cache from this instead of gpu_memory_utilization
            kv_cache = ro.kv_cache_gb * GIB
            total = weights + overhead + kv_cache
        else:
            total = ro.gpu_memory_utilization * cl.gpu_mem_gb * GIB
            kv_cache = total - weights - overhead
        in_training = 0.0 if disagg else cl.vllm_sleep_residual_gb * GIB
    else:  # the transformers engine: whole model on every rank, never asleep; a cache per batch of rows
        weights = b * m.param_count()
        overhead = 0.0
        kv_cache = ro.max_batch_rows * cfg.max_model_len * kv_per_token
        total = weights + kv_cache
        in_training = 0.0 if disagg else weights
    return _EngineBudget(weights, overhead, kv_cache, total, in_training, kv_per_token)


def _state_terms(
    cfg: PlanConfig, stage: int, params: int, lora_params: int, expert_params: int, dp: int, edp: int
) -> dict[str, float]:
    """Bytes of the training state on one GPU of pipeline stage ``stage`` holding ``params`` parameters
    (``expert_params`` of them routed experts): weights, grads, optimizer, ref_model, and the vision tower's
    vision_weights and vision_state (included in the first four too)."""
    m, par, b = cfg.model, cfg.parallel, cfg.dtype_bytes
    c: dict[str, float] = {}
    trained = lora_params if cfg.lora else params  # LoRA: the adapters are all the trainer updates
    c["weights"] = b * (params + (trained if cfg.lora else 0))  # LoRA: the adapters beside the frozen base
    c["grads"] = 4 * trained
    # bf16: fp32 master weights + Adam m, v; fp32: the parameters are the master copy, only m and v. The
    # distributed optimizer shards dense state over DP and the routed experts' over expert-DP.
    per_param = 8 if b == 4 else 12
    e = 0 if cfg.lora else expert_params
    if par.distributed_optimizer:
        c["optimizer"] = per_param * ((trained - e) / dp + e / edp)
    else:
        c["optimizer"] = per_param * trained
    c["ref_model"] = b * params if cfg.keeps_ref_model and not cfg.lora else 0
    v = m.vision if stage == 0 else None  # the tower sits on the first pipeline stage
    pv = v.param_count() if v is not None else 0
    c["vision_weights"] = b * pv
    c["vision_state"] = (4 + per_param) * pv if cfg.trains_vision else 0
    c["weights"] += c["vision_weights"]
    c["grads"] += 4 * pv if cfg.trains_vision else 0
    c["optimizer"] += per_param * pv if cfg.trains_vision else 0
    c["ref_model"] += b * pv if c["ref_model"] else 0
    return c


def _activation_terms(cfg: PlanConfig, stage: int, n_moe: int) -> dict[str, float]:
    """Bytes of activations and logits on one GPU of pipeline stage ``stage`` (``n_moe`` of its layers MoE):
    act_none, act_full, vision_activations, activations (the configured recompute mode), logits, logits_chunk.
    Context parallelism: a GPU holds 1 / cp of every sequence's tokens, so every per-token term (activations,
    logits) is for T / cp tokens (the attention's own keys and values, gathered or passed around the ring, are
    transient and not stored for backward beyond the local ones)."""
    m, par, tr, b = cfg.model, cfg.parallel, cfg.train, cfg.dtype_bytes
    T = -(-cfg.micro_batch_tokens // par.cp)
    # Megatron trains MoE layers with tp > 1 only under sequence parallelism (the model args switch it on)
    sp = cfg.sequence_parallel or (m.is_moe and par.tp > 1)
    a_layer = activation_bytes_per_layer(m, T, par.tp, sp, b)
    a_moe = moe_activation_bytes_per_layer(m, T, par.tp, par.expert_tp, sp) * b // 2 if m.is_moe else 0
    n_local = m.layers // par.pp
    in_flight = par.pp - stage  # 1F1B: stage s holds pp - s micro-batches of activations (Korthikanti Sec. 4.2.3)
    c: dict[str, float] = {}
    c["act_none"] = in_flight * ((n_local - n_moe) * a_layer + n_moe * a_moe)
    # Full recompute stores only each layer's input ([T, h], sharded by SP) and rebuilds one layer.
    layer_input = b * T * m.hidden // (par.tp if sp else 1)
    c["act_full"] = in_flight * n_local * layer_input + (max(a_layer, a_moe) if n_moe else a_layer)
    v = m.vision if stage == 0 else None
    if v is not None:
        per_block = v.activation_bytes_per_block(cfg.image_patches_per_micro_batch, b)
        c["vision_activations"] = in_flight * v.depth * per_block if cfg.trains_vision else per_block
        c["act_none"] += c["vision_activations"]
        c["act_full"] += c["vision_activations"]
    else:
        c["vision_activations"] = 0
    c["activations"] = c["act_full"] if tr.recompute == "full" else c["act_none"]
    last = stage == par.pp - 1
    vocab_shard = m.padded_vocab(par.tp) // par.tp
    c["logits"] = T * vocab_shard * (b + b) if last else 0  # logits + their grad, in the model dtype
    c["logits_chunk"] = min(tr.logits_chunk, T) * vocab_shard * 4 * LOGITS_CHUNK_FACTOR if last else 0
    c["teacher_logits"] = T * vocab_shard * b if last and cfg.teacher_logits else 0  # forward only: no grad
    return c


@dataclass
class CPCommVolume:
    """Bytes one GPU sends in the context-parallel attention exchange, for ONE transformer layer and ONE micro-batch
    (``cp_comm_bytes_per_layer``)."""

    forward: int
    """The forward pass's exchange."""
    backward: int
    """The backward pass's own exchange (gradients of keys and values, or of the all-to-all's inputs)."""
    recompute: int
    """The forward exchange again in backward when the layer is recomputed (``train.recompute=full``), else 0."""

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.recompute


def cp_comm_bytes_per_layer(cfg: PlanConfig) -> CPCommVolume:
    """Bytes ONE GPU sends per layer per micro-batch for context parallelism's attention, by ``parallel.cp_comm_type``.

    With T the micro-batch's tokens, t = ceil(T / cp) the tokens a GPU holds, b the dtype's bytes and
    k = max(1, kv_heads / tp) x head_dim the key (= value) width on one TP rank (a KV head is replicated when
    tp > kv_heads), q = heads / tp x head_dim the query width:
        all_gather  forward: gather the K and V of the other cp - 1 ranks            (cp - 1) t 2k b
                    backward: reduce-scatter dK and dV back to their owners          (cp - 1) t 2k b
        p2p (ring)  forward: cp - 1 steps, each passing one rank's K and V on        (cp - 1) t 2k b
                    backward: K, V and their gradients dK, dV go around the ring   2 (cp - 1) t 2k b
        a2a         forward: all-to-all of Q, K, V (sequence -> heads) and of the attention output (heads ->
                    sequence); a GPU keeps 1 / cp of what it holds            (cp - 1) / cp t (2q + 2k) b
                    backward: the same all-to-alls on the gradients           (cp - 1) / cp t (2q + 2k) b
    Full recompute runs the forward (and its exchange) once more in backward. cp = 1 exchanges nothing. Megatron's
    zig-zag split gives every rank the same t, so every GPU of the CP group sends the same volume."""
    m, par = cfg.model, cfg.parallel
    cp, b = par.cp, cfg.dtype_bytes
    if cp == 1:
        return CPCommVolume(0, 0, 0)
    t = -(-cfg.micro_batch_tokens // cp)
    k = max(1, m.kv_heads // par.tp) * m.head_dim
    q = m.heads // par.tp * m.head_dim
    if par.cp_comm_type == "a2a":
        fwd = (cp - 1) * t * (2 * q + 2 * k) * b // cp
        bwd = fwd
    else:
        fwd = (cp - 1) * t * 2 * k * b
        bwd = fwd if par.cp_comm_type == "all_gather" else 2 * fwd
    return CPCommVolume(fwd, bwd, fwd if cfg.train.recompute == "full" else 0)


def _misfit_reasons(plan: MemoryPlan, engine: _EngineBudget) -> list[str]:
    """Why the estimated peaks do not fit (an engine without room for one sequence, a phase over the limit), each
    with the settings that would help."""
    cfg = plan.config
    par, ro, tr, cl = cfg.parallel, cfg.rollout, cfg.train, cfg.cluster
    vllm, disagg = cfg.engine == "vllm", plan.disaggregated
    reasons = []
    limit = plan.limit
    lim_txt = f"{limit / GIB:.1f} GiB usable ({cl.gpu_mem_gb:g} x {cl.usable_fraction:g})"
    raise_kv = "rollout.kv_cache_gb" if ro.kv_cache_gb is not None else "rollout.gpu_memory_utilization"
    if vllm and engine.kv_cache <= 0:
        reasons.append(
            f"vLLM: rollout.gpu_memory_utilization={ro.gpu_memory_utilization:g} gives "
            f"{engine.total / GIB:.1f} GiB, less than its weights ({engine.weights / GIB:.1f} GiB at rollout_tp="
            f"{par.rollout_tp}) + overhead ({cl.vllm_overhead_gb:g} GiB): no room for a KV cache; raise "
            "gpu_memory_utilization or rollout_tp"
        )
    elif vllm and plan.kv_tokens < cfg.max_model_len:
        reasons.append(
            f"vLLM: KV cache holds {plan.kv_tokens} tokens, less than one sequence of max_model_len="
            f"{cfg.max_model_len} (vLLM refuses to start); raise {raise_kv} or parallel.rollout_tp"
        )
    if plan.train_peak > limit:
        hint = "set train.recompute=full, " if tr.recompute != "full" else ""
        who = "a training rank" if disagg else "training phase"
        reasons.append(
            f"{who} needs {plan.train_peak / GIB:.1f} GiB on pipeline stage {plan.worst_stage}, over {lim_txt}; "
            f"{hint}lower train.micro_batch_tokens, raise tp/pp, or add nodes (shards the optimizer further)"
        )
    name, lower = ("vLLM", raise_kv) if vllm else ("transformers engine", "rollout.max_batch_rows")
    if disagg and plan.rollout_peak > limit:
        reasons.append(
            f"a rollout rank needs {plan.rollout_peak / GIB:.1f} GiB ({name} {engine.total / GIB:.1f} + overhead), "
            f"over {lim_txt}; lower {lower} or raise parallel.rollout_tp"
        )
    elif plan.rollout_peak > limit:
        reasons.append(
            f"rollout phase needs {plan.rollout_peak / GIB:.1f} GiB (training state "
            f"{plan.components['train_state_in_rollout'] / GIB:.1f} + {name} {engine.total / GIB:.1f} + overhead), "
            f"over {lim_txt}; lower {lower}, set cluster.offload_during_rollout=true, or raise tp"
        )
    return reasons
