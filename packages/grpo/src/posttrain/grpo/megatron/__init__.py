"""The megatron backend of ``posttrain.grpo``: tensor (and sequence) parallel training of the
``posttrain.models`` decoder on megatron-core's parallel linears, data parallel over the rest.

* ``groups`` -- ``ParallelGroups``: the tp / dp / ep / expert-dp process groups, explicit.
* ``layers`` -- megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` computing with
  the decoder's own linear kernel (importing it imports megatron-core).
* ``model`` -- ``TensorParallelDecoder``: the decoder split over TP; HF checkpoints in and out
  across layouts.
* ``grads`` -- the explicit gradient rules (TP sums of partial grads, DP mean) and the norm.
* ``backend`` -- ``MEGATRON``, this backend's ``posttrain.grpo.backend.TrainerBackend``
  (importing it imports no megatron-core).
* ``policy`` -- the GRPO policy on this backend (``build_megatron_policy``), LoRA through
  lora-core's megatron path.
* ``checkpoint`` -- layout-free checkpoints.
* ``expert_parallel`` / ``expert_state`` -- MoE experts split over an expert-parallel group,
  with our own all-to-all token dispatch (megatron-core's MoE layer does not run on gloo).

Pipeline parallelism is out of scope of this backend (``GrpoConfig.check_supported``).
"""
