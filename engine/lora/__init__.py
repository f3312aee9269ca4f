"""LoRA adapters served over the base model: which adapters a server knows (`registry`, no
torch), what one adapter's folder holds (`adapter`), and the adapters one step runs, held in
slots the model's layers read (`slots`)."""
