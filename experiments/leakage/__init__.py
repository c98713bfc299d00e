"""The attack stage (`fedpriv attack`): what a run let leak, scored, tabled and drawn."""
