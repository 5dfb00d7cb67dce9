"""What runs inside one start of the job, below the driver: stop requests (signals), the
start-up clock, staged copies, the run's start history. The driver and the components import
these; nothing here imports the driver or ``rlhpc.launch`` (the job shell above the loop)."""
