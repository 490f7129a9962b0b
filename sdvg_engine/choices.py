"""The values a user chooses from, in one torch-free home: the engine checks against these, and the CLI
(whose ``--help`` imports no torch) and the ComfyUI nodes offer them."""

#: what a run does (:class:`sdvg_engine.options.SDVGOptions` ``mode``)
MODES = ("sdvg", "target_only", "draft_only", "first_block_only", "random", "schedule")
#: how a reward router's tau is read (:class:`sdvg_engine.router.RewardRouter` ``tau_mode``)
TAU_MODES = ("fixed", "accept_rate", "relative", "anchor", "baseline")
#: the tau modes whose tau is a margin over a reference built from the committed blocks' scores
REFERENCE_MODES = ("relative", "anchor", "baseline")
#: which models stream their transformer blocks from CPU RAM (``load_pipeline(offload=)``, ``--offload``)
OFFLOAD_CHOICES = ("none", "target", "both")
#: the KV caches' storage dtype (``kv_dtype``; ``auto`` = the model's compute dtype)
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")
#: the default ``k`` of mode ``schedule`` (the target makes block 0 and every k-th block)
SCHEDULE_EVERY = 3

#: what the routing state (the reference modes' committed scores, accept_rate's pool) does at a prompt switch
SWITCH_ROUTING = ("reset", "carry")
