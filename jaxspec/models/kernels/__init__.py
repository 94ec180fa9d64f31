"""Pallas kernels for the target model's hot loops (one module per kernel); the XLA code in the model packages is
the CPU default and the reference they are tested against."""
