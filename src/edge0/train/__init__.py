"""Everything that trains: the teacher, the prerouter heads (phase 1), the recovery LoRA
(phase 2 SFT, phase 3 on-policy distillation), their data and the reports.

It imports the serving code, because it trains on the served path; nothing on the serving
path imports it.
"""
