//! A hostile pass on local mode's hold after a body's own `COMMIT`: the
//! drop guard and the hold written on the call's own connection.

use super::*;
