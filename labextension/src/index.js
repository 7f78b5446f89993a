// meshlab's JupyterLab plugin: a notebook is marked modified when its content changed, not
// when the widget manager loads the widget state saved in it.
//
// With "save widget state" on (`meshlab lab-settings` turns it on), the widget manager sets
// `model.dirty` each time it registers a widget model, restoring the notebook's own saved
// widgets included: a notebook reopened untouched reads as modified within seconds and asks
// "Save changes?" on close. Every real change (a cell edited or run, metadata, outputs, a
// widget state written at save time) goes through the model's `contentChanged` first, so a
// `dirty` with no content change since the notebook was last clean is undone.
import { INotebookTracker } from "@jupyterlab/notebook";

function markDirtyOnlyOnChange(model) {
  let changed = false;
  model.contentChanged.connect(() => { changed = true; });
  model.stateChanged.connect((_, change) => {
    if (change.name !== "dirty") return;
    if (!change.newValue) changed = false; // loaded, saved or reverted: clean from here
    else if (!changed) model.dirty = false;
  });
}

const plugin = {
  id: "meshlab-lab:saved-widgets",
  description: "A notebook reopened with saved widget state is not marked modified.",
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app, tracker) => {
    tracker.widgetAdded.connect((_, panel) => markDirtyOnlyOnChange(panel.context.model));
  },
};

export default plugin;
