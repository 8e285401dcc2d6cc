"""Applications built on minddp: the course's training workflow (`train.py`)."""
