"""Calibration: measure this machine and the project's own code, and write a hardware profile.

The one part of the performance-model story that runs real code (torch kernels, the model's
modules, the comm layer's exchanges, MPI ping-pong), so it sits above the runtime in the
layering; ``megainfer.perfmodel`` stays a pure model that only reads the profiles written here.
"""
