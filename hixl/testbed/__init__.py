"""The test bed: the rxe VM runner and its guest agent, the multi-host tier, rxe set-up
and the doctor.  Nothing here is needed to move bytes."""
