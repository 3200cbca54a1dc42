"""Formats several layers speak: the answer tags and number parsing of the math task (`answer`, shared by
`data/`, `rewards/` and presampling) and the PEFT LoRA adapter format (`lora`: names, `adapter_config.json`,
merging; shared by the trainer, the weight push, the reference engine and checkpoint conversion), and how a
run's files are written so that an interruption never cuts one short (`files`). A library:
it imports nothing of the package.
"""
