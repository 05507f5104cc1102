"""`qwen3vl oracle`: the compiled graph against an independent numpy reference, stage by stage."""
