"""The test bed: the rxe VM runner and its guest agent, the multi-host tier, rxe set-up,
the doctor, and small TCP helpers (``net``: a free port, listening ports) for tests,
benchmarks and the demo, and a handshake spoken by hand (``rawpeer``) for the
listener's attack tests.  Nothing here is needed to move bytes."""
