"""The megatron backend of ``posttrain.grpo``: tensor, sequence and expert parallel training."""
