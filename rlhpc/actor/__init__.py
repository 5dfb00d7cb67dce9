"""Training side: ``ActorGroup`` (driver-side fan-out) over ``TrainWorker`` ranks."""
