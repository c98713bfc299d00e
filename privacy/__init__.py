"""Privacy, by role: ``dp`` (mechanisms and their accounting, what clients disclose),
``anonymize`` (anonymizers and their release type), ``analysis`` (what a release or an
update reveals).

Nothing here imports Flower or fedpriv's run-config schema: every function takes plain
arguments, so each piece can be used on saved updates and releases.
"""
