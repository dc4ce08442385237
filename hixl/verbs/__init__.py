"""The one adapter over the verbs binding, and sysfs device discovery."""
