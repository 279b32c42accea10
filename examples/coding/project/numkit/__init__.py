"""numkit: small number and text helpers (the coding example's shipped project)."""
