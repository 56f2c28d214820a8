"""Soaks: faults at random or on purpose (kills, restarts, files that crash or hang the decoder,
simultaneous auto-starts), every delivered sample checked against a decode made outside joaderd."""
